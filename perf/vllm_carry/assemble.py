"""On the GPU machine: check and unpack one carried part of vLLM 0.33.0 (``build.py``); install once all are in.

``python3 perf/vllm_carry/assemble.py PART_DIR [PART_DIR ...]``: checks each part's sha256 against its
``part.json`` and the manifest, that it belongs to the same build as the parts already in, unpacks it into
``STAGE/tree`` (default ``/tmp/vllm_carry``, kept between the calls of one lease) and joins every split file
whose pieces are all in (checking the joined file's sha256). Then prints which parts are in and which are
missing. A part already in is checked and skipped.

``--install``: once every part is in, each unpacked wheel is zipped again (stored) and installed with
``pip install --no-deps --no-index --no-compile --target TARGET`` (default ``/tmp/vllm_site``); put TARGET
first on ``PYTHONPATH``. Skipped when TARGET already holds this build. Then :data:`PATCHES` are applied to
the installed tree (each once, each found exactly or the install fails): what the trim takes out must not be
imported where vLLM imports it unconditionally on CUDA. ``--status``: only print what is in.

Exit status: 0 done; 3 parts missing for ``--install``; 4 a part failed its check (carry it again);
2 a usage error. Standard library only (Python 3.10+).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile

MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[assemble {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


class PartError(Exception):
    """A part is damaged, or of another build."""


def load_state(stage: str) -> dict:
    path = os.path.join(stage, "state.json")
    return json.load(open(path)) if os.path.exists(path) else {"build_id": None, "parts": {}}


def save_state(stage: str, state: dict) -> None:
    tmp = os.path.join(stage, "state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, os.path.join(stage, "state.json"))


def _safe_members(tar: tarfile.TarFile, root: str):
    for m in tar.getmembers():
        dest = os.path.realpath(os.path.join(root, m.name))
        if not m.isfile() or not dest.startswith(os.path.realpath(root) + os.sep):
            raise PartError(f"unexpected member {m.name!r}")
        yield m


def take(part_dir: str, stage: str) -> dict:
    """Check and unpack one part; returns the manifest."""
    meta = json.load(open(os.path.join(part_dir, "part.json")))
    manifest = json.load(open(os.path.join(part_dir, "manifest.json")))
    listed = {p["name"]: p for p in manifest["parts"]}
    if meta["build_id"] != manifest["build_id"] or listed.get(meta["name"], {}).get("sha256") != meta["sha256"]:
        raise PartError(f"{part_dir}: part.json and manifest.json disagree")
    state = load_state(stage)
    if state["build_id"] not in (None, manifest["build_id"]):
        log(f"{stage} holds parts of build {state['build_id']}, this part is of {manifest['build_id']}: starting over")
        shutil.rmtree(os.path.join(stage, "tree"), ignore_errors=True)
        state = {"build_id": None, "parts": {}}
    archive = os.path.join(part_dir, meta["file"])
    digest = sha256_file(archive)
    if digest != meta["sha256"] or os.path.getsize(archive) != meta["bytes"]:
        raise PartError(f"{archive}: sha256 {digest[:12]}.. / {os.path.getsize(archive)} B, expected "
                        f"{meta['sha256'][:12]}.. / {meta['bytes']} B: carry it again")
    state["build_id"] = manifest["build_id"]
    if state["parts"].get(meta["name"]) == digest:
        log(f"{meta['name']} ({meta['bytes'] / MIB:.1f} MiB) checked; already unpacked")
        return manifest
    t0 = time.monotonic()
    root = os.path.join(stage, "tree")
    os.makedirs(root, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = list(_safe_members(tar, root))
        for m in members:
            dest = os.path.join(root, m.name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with tar.extractfile(m) as src, open(dest + ".tmp", "wb") as dst:
                shutil.copyfileobj(src, dst, MIB)
            os.chmod(dest + ".tmp", m.mode or 0o644)
            os.replace(dest + ".tmp", dest)
    state["parts"][meta["name"]] = digest
    save_state(stage, state)
    log(f"{meta['name']} checked and unpacked: {len(members)} files, {meta['raw_bytes'] / MIB:.1f} MiB in "
        f"{time.monotonic() - t0:.1f} s")
    join(manifest, root)
    return manifest


def join(manifest: dict, root: str) -> None:
    """Every split file whose pieces are all in: joined, checked, pieces removed."""
    for f in manifest["split_files"]:
        dest = os.path.join(root, f["path"])
        paths = [os.path.join(root, p["arc"]) for p in f["pieces"]]
        if os.path.exists(dest) and not any(os.path.exists(p) for p in paths):
            continue
        if not all(os.path.exists(p) for p in paths):
            continue
        with open(dest + ".tmp", "wb") as out:
            for p in paths:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, out, MIB)
        digest = sha256_file(dest + ".tmp")
        if digest != f["sha256"]:
            os.remove(dest + ".tmp")
            raise PartError(f"{f['path']}: joined sha256 {digest[:12]}.. differs from {f['sha256'][:12]}..")
        os.chmod(dest + ".tmp", f.get("mode") or 0o644)
        os.replace(dest + ".tmp", dest)
        for p in paths:
            os.remove(p)
        log(f"joined {f['path']} from {len(paths)} pieces ({f['bytes'] / MIB:.1f} MiB, sha256 checked)")


def status(stage: str, manifest: dict | None) -> tuple[list[str], list[str]]:
    state = load_state(stage)
    if manifest is None:
        in_ = sorted(state["parts"])
        log(f"{stage}: build {state['build_id']}, parts in: {in_ or 'none'}")
        return in_, []
    names = [p["name"] for p in manifest["parts"]]
    have = [n for n in names if state["parts"].get(n) == next(p["sha256"] for p in manifest["parts"]
                                                               if p["name"] == n)]
    missing = [n for n in names if n not in have]
    log(f"build {manifest['build_id']}: parts in {have or 'none'}; missing {missing or 'none'}")
    return have, missing


# (file under TARGET, text, replacement, why): vLLM 0.33 imports these on CUDA whatever backend is chosen.
# Found on the H200 (perf/results/h200_2026-12-03/run18_vllm_engine/), one engine start after another.
PATCHES = [
    ("vllm/vllm_flash_attn/__init__.py",
     "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(",
     "if False:  # carried without FlashAttention's extensions: reported unavailable, Triton attention used\n"
     "    raise ImportError(",
     "v1/attention/backends/fa_utils.py imports vllm.vllm_flash_attn on CUDA; without _vllm_fa2_C/_vllm_fa3_C "
     "(trimmed) it raised ImportError, so no model whose module imports the attention layer could be inspected"),
    ("vllm/v1/sample/ops/topk_topp_sampler.py",
     "    from vllm.v1.attention.backends.flashinfer import FlashInferBackend\n",
     "    try:  # carried without FlashInfer\n"
     "        from vllm.v1.attention.backends.flashinfer import FlashInferBackend\n"
     "    except ImportError:\n"
     "        return False\n",
     "flashinfer_sampler_supported() imports the FlashInfer backend (flashinfer is not carried): the model "
     "runner's Sampler() raised ModuleNotFoundError at load_model"),
    ("vllm/models/qwen4_exp/nvidia/hyperconnection.py",
     "                and current_platform.has_device_capability(90)\n            )",
     "                and current_platform.has_device_capability(90)\n"
     "                and __import__(\"importlib.util\").util.find_spec(\"cutlass\") is not None  # no CuTe DSL\n"
     "            )",
     "Qwen4Exp's hyper-connection takes a CuTe-DSL down+SiLU GEMM on SM90 when hc_count * hidden_size is a "
     "multiple of 8 (the real model's 4 x 2,560); nvidia-cutlass-dsl (92 MB) is not carried, so it takes the "
     "Linear path vLLM itself takes above 48 tokens and on other GPUs"),
    ("vllm/models/qwen4_exp/nvidia/ops/cute_dsl/hc_down_silu.py",
     "    if not current_platform.has_device_capability(90) or k % 8 != 0:\n        return",
     "    if not current_platform.has_device_capability(90) or k % 8 != 0:\n        return\n"
     "    if __import__(\"importlib.util\").util.find_spec(\"cutlass\") is None:  # carried without CuTe DSL\n"
     "        return",
     "the same kernel's warm-up, requested at model construction, compiles it with CuTe DSL"),
]


def patch(target: str) -> None:
    """Apply :data:`PATCHES` to the tree installed in ``target`` (a patch already applied is skipped)."""
    for rel, old, new, why in PATCHES:
        path = os.path.join(target, rel)
        text = open(path).read()
        if new in text:
            continue
        if text.count(old) != 1:
            raise SystemExit(f"assemble: {rel}: the text to patch is not there exactly once ({why})")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
        log(f"patched {rel}: {why}")


def install(stage: str, manifest: dict, target: str, python: str) -> None:
    """Zip each unpacked wheel again (stored) and pip-install them all with --no-deps into ``target``."""
    mark = os.path.join(target, ".vllm_carry_build")
    if os.path.exists(mark) and open(mark).read().strip() == manifest["build_id"]:
        log(f"{target} already holds build {manifest['build_id']}")
        patch(target)
        return
    root = os.path.join(stage, "tree")
    wheels = os.path.join(stage, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    t0 = time.monotonic()
    for t in manifest["trees"]:
        src = os.path.join(root, t["wheel"][:-len(".whl")])
        files = sorted(os.path.relpath(os.path.join(dp, f), src) for dp, _, fs in os.walk(src) for f in fs)
        last = [f for f in files if f.endswith(".dist-info/RECORD")]  # RECORD last, as wheels have it
        with zipfile.ZipFile(os.path.join(wheels, t["wheel"]), "w", zipfile.ZIP_STORED) as z:
            for rel in [f for f in files if f not in last] + last:
                z.write(os.path.join(src, rel), rel)
    log(f"zipped {len(manifest['trees'])} wheels in {time.monotonic() - t0:.1f} s")
    if os.path.exists(target):
        shutil.rmtree(target)
    cmd = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", target] + \
        sorted(os.path.join(wheels, w) for w in os.listdir(wheels))
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    with open(mark, "w") as f:
        f.write(manifest["build_id"] + "\n")
    shutil.rmtree(wheels, ignore_errors=True)
    patch(target)
    log(f"installed {len(manifest['trees'])} wheels into {target} in {time.monotonic() - t0:.1f} s "
        f"(PYTHONPATH={target}:$PYTHONPATH)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("parts", nargs="*", help="part folders (each with pNN.tar.xz, part.json, manifest.json)")
    p.add_argument("--stage", default=os.environ.get("VLLM_CARRY_STAGE", "/tmp/vllm_carry"))
    p.add_argument("--target", default=os.environ.get("VLLM_CARRY_SITE", "/tmp/vllm_site"))
    p.add_argument("--install", action="store_true", help="install once every part is in")
    p.add_argument("--status", action="store_true", help="only say which parts are in")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pip installs")
    a = p.parse_args(argv)
    os.makedirs(a.stage, exist_ok=True)
    manifest = None
    for d in a.parts:
        try:
            manifest = take(d, a.stage)
        except (PartError, OSError, tarfile.TarError, EOFError, ValueError, KeyError) as e:
            log(f"FAILED {d}: {type(e).__name__}: {e}")
            status(a.stage, manifest)
            return 4
    if manifest is None:
        saved = os.path.join(a.stage, "manifest.json")
        manifest = json.load(open(saved)) if os.path.exists(saved) else None
    else:
        with open(os.path.join(a.stage, "manifest.json"), "w") as f:
            json.dump(manifest, f)
    have, missing = status(a.stage, manifest)
    if a.status or not a.install:
        return 0
    if manifest is None or missing:
        log(f"cannot install: {'no part is in' if manifest is None else 'missing ' + ', '.join(missing)}")
        return 3
    tree = os.path.join(a.stage, "tree")
    pending = [f["path"] for f in manifest["split_files"] if not os.path.exists(os.path.join(tree, f["path"]))]
    if pending:
        log(f"cannot install: split files not joined: {pending}")
        return 3
    install(a.stage, manifest, a.target, a.python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
