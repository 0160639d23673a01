"""Before a lease: do the carried vLLM's extensions link against torch 2.11, and does its Python import there?

``python3 perf/vllm_carry/cpu_check.py --python VENV/bin/python --site /tmp/vllm_site [--json FILE]``

Run on a CPU machine, in a Python 3.12 environment set up as the H200 is (torch 2.11.0, Triton 3.6.0,
transformers 5.17.0 and the H200's other packages; README: "vLLM on the H200"), with the parts installed by
``assemble.py --install --target SITE``:

1. ABI: every ``.so`` of the installed vLLM, its undefined dynamic symbols (``nm -D``) against what torch
   2.11's libraries (``torch/lib/*.so``) export. The stable-ABI ones (``aoti_torch_*``, ``torch_*``) and the
   C++ ones (``c10``/``at``/``torch`` namespaces) must all be there; anything else is left to the system,
   CUDA and the Python interpreter.
2. Imports: the modules the engine check needs, one subprocess each, with ``SITE`` first on
   ``PYTHONPATH`` and a stub ``libcuda.so.1`` (built here with ``cc``: every driver entry point the
   extensions name returns ``CUDA_ERROR_NO_DEVICE``) so that the extensions load on a machine without a
   driver. Prints one line per module, and the error's last line where one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

#: (module, attribute or None, what it is) the engine check goes through, in import order
MODULES = [
    ("vllm", "__version__", "the package"),
    ("vllm._C_stable_libtorch", None, "vLLM's CUDA ops (stable ABI)"),
    ("vllm._moe_C_stable_libtorch", None, "vLLM's MoE ops (stable ABI)"),
    ("vllm._qutlass_C", None, "FP4 ops (needs torch 2.13; vLLM imports it in a try/except)"),
    ("vllm.config", "VllmConfig", "the engine's config"),
    ("vllm", "LLM", "the offline API"),
    ("vllm.v1.engine.core", "EngineCore", "the engine core"),
    ("vllm.v1.engine.llm_engine", "LLMEngine", "the engine client"),
    ("vllm.v1.worker.gpu_worker", "Worker", "the GPU worker"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "the model runner"),
    ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend", "Triton attention"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionBackend", "GDN (linear attention) metadata"),
    ("vllm.compilation.backends", "VllmBackend", "torch.compile backend"),
    ("vllm.model_executor.layers.fused_moe.fused_moe", "fused_experts", "Triton fused MoE"),
    ("vllm.model_executor.layers.fused_moe.layer", "FusedMoEFactory", "the MoE layer"),
    ("vllm.model_executor.models.registry", "ModelRegistry", "the model registry"),
    ("vllm.model_executor.models.gemma3n", "Gemma3nForCausalLM", "Gemma 3n (text)"),
    ("vllm.model_executor.models.gemma3n_mm", "Gemma3nForConditionalGeneration", "Gemma 3n (multimodal)"),
    ("vllm.models.qwen4_exp.nvidia.model", "Qwen4ExpForCausalLM", "Qwen4Exp (CUDA)"),
    ("vllm.models.qwen4_exp.common.ngram_embedding", "Qwen4ExpPLEFp8EmbeddingMethod", "Qwen4Exp n-gram PLE"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention", "Qwen GDN"),
    ("vllm.entrypoints.openai.api_server", "build_app", "the OpenAI server"),
    ("vllm.entrypoints.cli.main", "main", "the vllm CLI"),
    ("uvaple.integration.models.vllm", "register", "the plugin"),
    ("uvaple.integration.models.vllm.gemma3n", "UvapleGemma3nForConditionalGeneration", "the plugin's Gemma 3n"),
    ("uvaple.integration.models.vllm.qwen4_exp", "UvapleQwen4ExpForCausalLM", "the plugin's Qwen4Exp"),
]

_TORCH_CXX = re.compile(r"^_ZN(K)?(3c10|2at|5torch|6caffe2)")
STUB_RC = 100  # CUDA_ERROR_NO_DEVICE


def nm(path: str, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True, text=True).stdout
    syms = set()
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        if not defined and parts[0] == "w":  # weak: may stay unresolved
            continue
        syms.add(parts[-1].split("@")[0])
    return syms


def abi(site: str, torch_lib: str) -> dict:
    """Per extension: its torch symbols, and those torch 2.11's libraries do not export."""
    exported: set[str] = set()
    for f in sorted(os.listdir(torch_lib)):
        if ".so" in f:
            exported |= nm(os.path.join(torch_lib, f), defined=True)
    out = {}
    root = os.path.join(site, "vllm")
    for dp, _, fs in os.walk(root):
        for f in sorted(fs):
            if not f.endswith(".so"):
                continue
            need = nm(os.path.join(dp, f), defined=False)
            stable = {s for s in need if s.startswith(("aoti_torch_", "torch_"))}
            cxx = {s for s in need if _TORCH_CXX.match(s)}
            out[os.path.relpath(os.path.join(dp, f), site)] = {
                "undefined": len(need), "stable_abi": len(stable), "torch_cxx": len(cxx),
                "missing": sorted((stable | cxx) - exported),
                "cuda_driver": sorted(s for s in need if re.match(r"^cu[A-Z]", s)),
            }
    return out


def stub_driver(symbols: set[str], where: str) -> str:
    """A ``libcuda.so.1`` whose every named entry point returns CUDA_ERROR_NO_DEVICE."""
    src = os.path.join(where, "libcuda_stub.c")
    with open(src, "w") as f:
        for s in sorted(symbols | {"cuInit", "cuDriverGetVersion", "cuDeviceGetCount", "cuGetProcAddress"}):
            f.write(f"int {s}(void) {{ return {STUB_RC}; }}\n")
    lib = os.path.join(where, "libcuda.so.1")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", lib, src], check=True)
    return where


def imports(python: str, site: str, stub_dir: str) -> list[dict]:
    env = dict(os.environ, LD_LIBRARY_PATH=stub_dir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
               PYTHONPATH=site, VLLM_LOGGING_LEVEL="ERROR", CUDA_VISIBLE_DEVICES="")
    rows = []
    for mod, attr, what in MODULES:
        code = f"import importlib; m = importlib.import_module({mod!r})"
        if attr:
            code += f"; v = getattr(m, {attr!r}); print(v if isinstance(v, str) else getattr(v, '__name__', v))"
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        err = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        rows.append({"module": mod, "attr": attr, "what": what, "ok": r.returncode == 0,
                     "value": r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else None,
                     "error": err[-1] if r.returncode and err else None})
        mark = "ok  " if r.returncode == 0 else "FAIL"
        print(f"{mark} {mod}{'.' + attr if attr else ''} ({what})" + (f": {rows[-1]['error']}" if r.returncode else ""),
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", required=True, help="the Python 3.12 set up as the H200 is (torch 2.11 ...)")
    p.add_argument("--site", default="/tmp/vllm_site", help="where assemble.py --install put the parts")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    torch_lib = subprocess.run([a.python, "-c", "import os, torch; print(os.path.join(os.path.dirname("
                                "torch.__file__), 'lib'))"], capture_output=True, text=True,
                               check=True).stdout.strip().splitlines()[-1]
    versions = subprocess.run([a.python, "-c", "import torch, triton, transformers; print(torch.__version__, "
                               "triton.__version__, transformers.__version__)"], capture_output=True, text=True,
                              check=True).stdout.split()
    print(f"torch {versions[0]}, Triton {versions[1]}, transformers {versions[2]}; torch libraries {torch_lib}")
    report = abi(a.site, torch_lib)
    print("\nABI: the extensions' undefined torch symbols against torch's exports (nm -D)")
    for so, r in report.items():
        state = "all exported" if not r["missing"] else f"{len(r['missing'])} MISSING: {', '.join(r['missing'][:6])}"
        print(f"  {so}: {r['stable_abi']} stable-ABI + {r['torch_cxx']} C++ torch symbols, {state}")
    driver = set().union(*(set(r["cuda_driver"]) for r in report.values()))
    with tempfile.TemporaryDirectory() as tmp:
        stub = stub_driver(driver, tmp)
        print(f"\nimports (a stub libcuda.so.1 with {len(driver)} driver entry points, {a.site} first on the path)")
        rows = imports(a.python, a.site, stub)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"versions": versions, "abi": report, "imports": rows}, f, indent=1)
    failed = [r["module"] for r in rows if not r["ok"] and r["module"] != "vllm._qutlass_C"]
    bad_abi = [so for so, r in report.items() if r["missing"] and "stable_libtorch" in so]
    print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} imported (vllm._qutlass_C is expected not to); "
          f"failed otherwise: {failed or 'none'}; stable-ABI extensions with missing symbols: {bad_abi or 'none'}")
    return 1 if failed or bad_abi else 0


if __name__ == "__main__":
    sys.exit(main())
