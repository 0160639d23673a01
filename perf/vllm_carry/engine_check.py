"""Does vLLM's real engine serve Gemma 3n and Qwen4Exp on the H200 with the uvaple plugin, with HBM's tokens?

``python3 perf/vllm_carry/engine_check.py --out DIR [--work /tmp/vllm_engine] [--models ...] [--modes eager,graph]
[--configs hbm,host,uva,...] [--graph-levels default,inproc] [--only tokens,serve] [--parallel 4] [--deadline-s 480]
[--checkpoints-only] [--force]``

Runs on the GPU machine with vLLM 0.33.0 carried there (``assemble.py --install``; ``perf/gpu_check.sh
vllm_engine`` puts ``/tmp/vllm_site`` first on ``PYTHONPATH``), through vLLM's public API only:

1. ``env``: versions, vLLM's requirements against what is installed, the extensions on the GPU (one
   ``rms_norm`` of ``vllm._custom_ops`` against torch), whether vLLM discovers the plugin's entry point.
2. ``checkpoints`` (``checkpoints.py``, which also runs alone on a CPU without vLLM; ``--checkpoints-only``
   here): small random models saved by transformers into ``WORK/ckpt``: ``gemma3n`` (the multimodal
   ``Gemma3nForConditionalGeneration``, bf16, a 128 MiB per-layer table, text prompts: no image or audio, so no
   tower is profiled, and ``enable_mm_embeds`` so that vLLM still runs its multimodal path, which computes the
   per-layer inputs), ``qwen4exp_bf16`` (PLE on two linear-attention layers, n-gram tables in
   ``split_ngram_parts`` shards) and ``qwen4exp_fp8`` (the same tables in fp8 with one global scale each).
3. ``tokens``: per model and mode (``eager``: ``enforce_eager``; ``graph``: vLLM's compilation and CUDA
   graphs at their defaults), one engine per configuration of :data:`CONFIGS` that applies, ``--parallel`` (4)
   side by side on the GPU (each with the same fixed ``kv_cache_memory_bytes``: vLLM then skips the memory
   profiling that engines starting side by side upset; twelve side by side, with the GPU tests running, did not
   start within 240 s on the H200's 16 cores). Eager engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Each
   generates greedy tokens for 8 prompts of 6 to 40 words (``ignore_eos``, :data:`MAX_TOKENS` tokens, top-2
   logprobs, kept as the floats vLLM returns) and is compared with its reference (``hbm``; the ``fp8_row``
   configurations with ``device_fp8row``, the same encoding in HBM): tokens identical, and every logprob equal
   (or how many differ, and by how much). A configuration the plugin must refuse for this engine (``copy`` under
   CUDA graphs, ``split`` anywhere) passes when the engine stops at start-up with the named error. Recorded per
   engine: weights' and KV cache's GPU memory, the plugin's segments while it runs (``uvaple shm list --json``:
   each table once), the segments left after it exits, the log lines naming the placement.
   The copy question (``copy``'s logprobs differed from the plugin-off engine's in eager mode): ``hbm`` and
   ``copy`` each run twice (``hbm_again``, ``copy_again``); the JSON's ``repeats`` says whether an engine
   differs from itself. Under CUDA graphs ``hbm`` and ``uva`` each run twice (``hbm_again``, ``uva_again``):
   there ``uva`` differed from ``hbm`` (every prompt's logprobs by about 1e-5 from the first token, one token
   at a near tie) where ``device``, ``host`` and ``off`` did not. ``--graph-levels inproc`` runs the graph
   configurations again with the engine core in the run's own process (:data:`GRAPH_LEVELS`), which takes the
   engine's scheduling out of the comparison.
4. ``serve``: ``vllm serve`` (``--serve-model``, ``uva``, eager, ``PROMETHEUS_MULTIPROC_DIR`` set), an OpenAI
   client completion compared with the offline ``uva`` engine's text, ``/metrics``' ``uvaple_*`` series, a
   server started with a bad ``uvaple`` setting (it must exit with the named error), no segment left after the
   server stops.

Decode throughput is measured by ``decode_bench.py`` (a model at the real dimensions; this check's models are
too small to show a lookup's cost). vLLM 0.33 has no ``VLLM_ATTENTION_BACKEND``: the Triton backend is chosen
with ``attention_backend="TRITON_ATTN"``; Qwen4Exp's GDN prefill with ``additional_config["gdn_prefill_backend"]
= "triton"`` (FlashAttention and FlashInfer are not carried).

A run that fails is a result: its call and the error's last lines are recorded, and the first failure that
every configuration shares (vLLM itself) is recorded as ``blocker``. Runs already done in ``WORK`` are not
repeated (``--force`` repeats them), so calls of one lease continue where the last one stopped. Writes
``DIR/engine_check.json`` and ``DIR/engine_check.log``. ``--resume RUNS`` takes an earlier lease's run results
(its ``runs/`` folder, brought back and committed under ``perf/results/``) as done where they served the same
checkpoint bytes (each run records its checkpoint's SHA-256) on the same GPU model (each run records it; engines
on an H100 and an H200 need not agree to the bit), so the matrix can be finished over several leases.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

from checkpoints import MODELS, checkpoints, prompts  # this folder (a script's folder is on sys.path)

HERE = os.path.abspath(__file__)
GIB = 1 << 30

QWEN = ("qwen4exp_bf16", "qwen4exp_fp8")
#: what each configuration runs: ``plugin`` (the uvaple plugin loaded), ``engram`` (Qwen4Exp's engram_config;
#: None: vLLM's default, cpu_offload=True, its own pinned host path), ``uvaple`` (the plugin's settings; None: not
#: enabled), ``models``/``modes`` (where it applies; None: every one), ``expect`` (mode -> the named error the
#: engine must stop with at start-up), ``ref`` (the configuration it is compared with), ``inproc`` (the engine in
#: the run's own process under CUDA graphs too: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), ``engine`` (more of
#: ``vllm.LLM``'s arguments). The ``_inproc`` and ``_sync`` pairs take apart what differs between ``uva`` and ``hbm``
#: under graphs: the engine core's own process, or the overlap of a step's preparation with the last step's work.
CONFIGS: dict[str, dict] = {
    "hbm": dict(plugin=False, engram={"cpu_offload": False}),
    "hbm_again": dict(plugin=False, engram={"cpu_offload": False}),
    "host": dict(plugin=False, engram=None, models=QWEN),
    "off": dict(plugin=True, engram={"cpu_offload": False}),
    "uva": dict(plugin=True, uvaple={"placement": "uva"}),
    "uva_again": dict(plugin=True, uvaple={"placement": "uva"}, modes=("graph",)),
    "device": dict(plugin=True, uvaple={"placement": "device"}),
    "copy": dict(plugin=True, uvaple={"placement": "copy"},
                 expect={"graph": "placement 'copy' cannot run inside vLLM's CUDA graphs"}),
    "copy_again": dict(plugin=True, uvaple={"placement": "copy"}, modes=("eager",)),
    "split": dict(plugin=True, uvaple={"placement": "split"}, modes=("eager",),
                  expect={"eager": "'split' cannot serve vLLM"}),
    "hbm_inproc": dict(plugin=False, engram={"cpu_offload": False}, models=QWEN, modes=("graph",), inproc=True),
    "uva_inproc": dict(plugin=True, uvaple={"placement": "uva"}, models=QWEN, modes=("graph",), inproc=True,
                       ref="hbm_inproc"),
    "hbm_sync": dict(plugin=False, engram={"cpu_offload": False}, modes=("graph",), engine={"async_scheduling": False}),
    "uva_sync": dict(plugin=True, uvaple={"placement": "uva"}, modes=("graph",), engine={"async_scheduling": False},
                     ref="hbm_sync"),
    "uva_dedup": dict(plugin=True, uvaple={"placement": "uva", "dedup": True}),
    # a table file per shard in the engine's own cache folder, behind a row cache of 60 MB: about half of each toy
    # table, and more than a step of vLLM's largest batch of tokens brings (checked at start-up)
    "disk": dict(plugin=True, uvaple={"placement": "disk", "disk_cache_gb": 0.06},
                 expect={"graph": "placement 'disk' cannot run inside vLLM's CUDA graphs"}),
    "uva_hot": dict(plugin=True, uvaple={"placement": "uva", "hot_cache_gb": 0.01}, models=("gemma3n",)),
    "uva_fp8row": dict(plugin=True, uvaple={"placement": "uva", "quantize": "fp8_row"}, models=("qwen4exp_bf16",),
                       ref="device_fp8row"),
    "device_fp8row": dict(plugin=True, uvaple={"placement": "device", "quantize": "fp8_row"},
                          models=("qwen4exp_bf16",), ref="device_fp8row"),
}
MODES = ("eager", "graph")
PHASES = ("tokens", "serve")
#: graph mode's levels, each compared within itself (``--graph-levels``): ``default``, vLLM's defaults as a user
#: gets them (compilation and CUDA graphs, FULL_AND_PIECEWISE, the engine core in its own process); ``inproc``,
#: the same engines in the run's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Out of process,
#: ``LLM.generate`` hands the prompts to a core that already steps, so which of them share a step (every GEMM's
#: shape, and so its bits) can follow how fast the engine is; in process every prompt is queued before the first
#: step. A configuration that differs from HBM out of process and not in process differs by that, not by its rows.
GRAPH_LEVELS = {"default": None, "inproc": None}  # level -> compilation_config (None: vLLM's default)
INPROC_LEVELS = ("inproc",)
MAX_TOKENS = 256
MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 32
KV_CACHE_BYTES = 1 * GIB  # each engine's, fixed: no memory profiling (engines start side by side)
GPU_UTIL = 0.04  # vLLM's start-up check of free memory only, once kv_cache_memory_bytes is set


def applies(config: str, model: str, mode: str) -> bool:
    c = CONFIGS[config]
    return model in (c.get("models") or (model,)) and mode in (c.get("modes") or MODES)


#: the seconds a group of engines takes before one has run in this WORK (the first eager group on a fresh
#: machine, Triton compiling into an empty cache: ~190 s; a graph group: ~100 s once the cache is warm)
GROUP_S = {"eager": 150, "graph": 330}


def group_need(mode: str, seen: float | None) -> float:
    """The time left that a group of ``mode`` needs to start: the longest group of that mode this WORK has run,
    with a margin, or :data:`GROUP_S` before any has."""
    return GROUP_S[mode] if not seen else 1.2 * seen + 20


def reference(config: str) -> str:
    return CONFIGS[config].get("ref", "hbm")


def now() -> str:
    return time.strftime("%H:%M:%S")


class Log:
    def __init__(self, path: str | None) -> None:
        self.f = open(path, "a", buffering=1) if path else None

    def __call__(self, msg: str) -> None:
        line = f"[engine_check {now()}] {msg}"
        print(line, flush=True)
        if self.f:
            self.f.write(line + "\n")


# ============================================================================================== one engine
def vllm_env(plugin: bool, logging_config_path: str, cache_root: str, **extra: str) -> dict:
    """The environment of one engine: offline, vLLM's logging with the ``uvaple`` logger, its own compile cache,
    no ``UVAPLE_*`` variable of the caller's, and the plugin loaded (``plugin``) or left out (vLLM alone: every
    general plugin but uvaple)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CONFIGURE_LOGGING="1",
               VLLM_LOGGING_CONFIG_PATH=logging_config_path, VLLM_CACHE_ROOT=cache_root, PYTHONUNBUFFERED="1",
               **extra)
    if plugin:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = "lora_filesystem_resolver,lora_hf_hub_resolver"
    for k in [k for k in env if k.startswith("UVAPLE_")]:
        env.pop(k)
    return env


def child_env(spec: dict) -> dict:
    # eager engines run in this process (the copy question asks for it)
    inproc = (spec["mode"] == "eager" or CONFIGS[spec["config"]].get("inproc", False)
              or spec.get("level") in INPROC_LEVELS)
    extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if inproc else {}
    return vllm_env(CONFIGS[spec["config"]]["plugin"], spec["logging_config"], spec["cache_root"], **extra)


def engine_kwargs(spec: dict) -> dict:
    """``vllm.LLM``'s arguments for a run (also what the JSON records as the call)."""
    c = CONFIGS[spec["config"]]
    kw = dict(model=spec["ckpt"], tokenizer=spec["ckpt"], dtype="bfloat16", seed=0, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=MAX_NUM_SEQS, gpu_memory_utilization=GPU_UTIL, kv_cache_memory_bytes=KV_CACHE_BYTES,
              attention_backend="TRITON_ATTN", enforce_eager=spec["mode"] == "eager", disable_log_stats=False)
    kw.update(c.get("engine", {}))
    additional = {}
    if spec["model"] in QWEN:
        additional["gdn_prefill_backend"] = "triton"
        if c.get("engram") is not None:
            kw["engram_config"] = dict(c["engram"])
    if c.get("uvaple") is not None:
        additional["uvaple"] = dict(c["uvaple"], segment=spec["segment"])
        if "hot_cache_gb" in c["uvaple"]:
            additional["uvaple"]["hot_profile"] = spec["hot_profile"]
        if c["uvaple"].get("placement") == "disk":
            additional["uvaple"]["disk_dir"] = os.path.join(spec["cache_root"], "uvaple_tables")
    if additional:
        kw["additional_config"] = additional
    if spec["model"] == "gemma3n":
        # No image or audio per prompt (the towers are not profiled); with every limit 0 alone vLLM runs the
        # model text-only and its runner passes no inputs_embeds, which Gemma 3n's multimodal forward needs
        # (the H200's first engines stopped there, run18). enable_mm_embeds keeps the multimodal path: the
        # runner embeds through embed_input_ids, which computes the per-layer inputs.
        kw["limit_mm_per_prompt"] = {"image": 0, "audio": 0}
        kw["enable_mm_embeds"] = True
    if spec["mode"] == "graph" and spec.get("compilation") is not None:
        kw["compilation_config"] = spec["compilation"]
    return kw


def shm_list(segment: str | None = None) -> list[dict]:
    """``uvaple shm list --json`` (the segments whose name starts with ``uvaple.<segment>.``)."""
    r = subprocess.run([sys.executable, "-m", "uvaple", "shm", "list", "--json"], capture_output=True, text=True,
                       timeout=60)
    if r.returncode:
        raise RuntimeError(f"uvaple shm list --json: {r.stderr.strip()[-300:]}")
    rows = json.loads(r.stdout or "[]")
    return [x for x in rows if segment is None or str(x.get("name", "")).startswith((f"uvaple.{segment}.",
                                                                                      f"{segment}."))]


def segments_left(segment: str) -> list[dict]:
    """The plugin's segments (``segment``'s) a stopped engine left in ``/dev/shm``, as ``uvaple shm list`` shows
    them (or the error of listing them), then removed: the next engine starts with the host memory the first had."""
    time.sleep(1.0)
    try:
        left = shm_list(segment)
    except Exception as e:  # noqa: BLE001 - a check that fails is a result
        return [{"error": str(e)}]
    if left:
        subprocess.run([sys.executable, "-m", "uvaple", "shm", "clean"] + [x["name"] for x in left if "name" in x],
                       capture_output=True, timeout=120)
    return left


def keep_graphs(cache_root: str, dest: str) -> list[str]:
    """The FX graphs vLLM's compilation wrote under ``cache_root`` (``torch_compile_cache/<hash>/rank_*/<prefix>/
    computation_graph.py``: the model's graph as split into pieces, with every op and its arguments) copied into
    ``dest`` as ``<hash>.<rank>.<prefix>.py``: two engines' graphs can then be compared where their bits differ.
    Returns the names kept."""
    kept = []
    for path in sorted(glob.glob(os.path.join(cache_root, "torch_compile_cache", "*", "rank_*", "*",
                                              "computation_graph.py"))):
        prefix_dir = os.path.dirname(path)
        rank_dir = os.path.dirname(prefix_dir)
        name = ".".join((os.path.basename(os.path.dirname(rank_dir)), os.path.basename(rank_dir),
                         os.path.basename(prefix_dir), "py"))
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(path, os.path.join(dest, name))
        kept.append(name)
    return kept


def run_child(spec_path: str) -> int:
    """One engine (a subprocess of the check): build, generate, measure, write ``spec['result']``."""
    spec = json.load(open(spec_path))
    res: dict = {"spec": {k: v for k, v in spec.items() if k != "logging_config"}, "ok": False}

    def save():
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(spec["result"] + ".tmp", spec["result"])

    stage = "import"
    try:
        from vllm import LLM, SamplingParams

        kw = engine_kwargs(spec)
        res["call"] = "vllm.LLM(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"
        stage = "LLM()"
        t0 = time.monotonic()
        llm = LLM(**kw)
        res["init_s"] = round(time.monotonic() - t0, 1)
        if spec.get("expect"):
            res["started_though_refusal_expected"] = spec["expect"]
        cc = llm.llm_engine.vllm_config.cache_config
        res["num_gpu_blocks"], res["block_size"] = cc.num_gpu_blocks, cc.block_size
        comp = llm.llm_engine.vllm_config.compilation_config
        res["compilation"] = {"mode": str(getattr(comp, "mode", None)),
                              "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None))}
        if CONFIGS[spec["config"]].get("uvaple") is not None:
            stage = "uvaple shm list"
            res["segments"] = shm_list(spec["segment"])
        stage = "generate"
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts(), sp, use_tqdm=False)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["texts"] = [o.outputs[0].text for o in outs]
        # every step's two most likely tokens' logprobs, as vLLM returns them (float32 values: compared exactly)
        res["top2"] = [[sorted((lp.logprob for lp in step.values()), reverse=True)[:2]
                        for step in (o.outputs[0].logprobs or [])] for o in outs]
        stage = "shutdown"
        t0 = time.monotonic()
        llm.llm_engine.engine_core.shutdown()  # the engine core exits as it does when a server stops
        res["shutdown_s"] = round(time.monotonic() - t0, 1)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failed run is a result
        res["stage"] = stage
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-6000:]
    save()
    sys.stdout.flush()
    os._exit(0)  # whatever is left of the engine goes with our process group; the parent checks the segments


# ============================================================================================== the check
def logging_config(path: str) -> str:
    """vLLM's logging, with the ``uvaple`` logger at INFO on the same handler, in every vLLM process."""
    fmt = "%(levelname)s %(asctime)s [%(name)s %(filename)s:%(lineno)d] %(message)s"
    cfg = {"version": 1, "disable_existing_loggers": False,
           "formatters": {"plain": {"format": fmt, "datefmt": "%m-%d %H:%M:%S"}},
           "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain",
                                    "stream": "ext://sys.stdout", "level": "INFO"}},
           "loggers": {"vllm": {"handlers": ["console"], "level": "INFO", "propagate": False},
                       "uvaple": {"handlers": ["console"], "level": "INFO", "propagate": False}}}
    json.dump(cfg, open(path, "w"))
    return path


_KV_RE = re.compile(r"Available KV cache memory: ([0-9.]+) GiB")
_LOAD_RE = re.compile(r"Model loading took ([0-9.]+) GiB")
_CACHE_RE = re.compile(r"GPU KV cache size: ([0-9,]+) tokens")


def parse_log(path: str) -> dict:
    text = open(path, errors="replace").read() if os.path.exists(path) else ""
    out = {}
    for key, rx in (("kv_cache_gib", _KV_RE), ("weights_gib", _LOAD_RE)):
        m = rx.findall(text)
        if m:
            out[key] = float(m[-1])
    m = _CACHE_RE.findall(text)
    if m:
        out["kv_cache_tokens"] = int(m[-1].replace(",", ""))
    out["placement_lines"] = [ln.strip()[:300] for ln in text.splitlines()
                              if "uvaple" in ln and re.search(r"\b(uva|device|copy)\b|placement", ln)][:8]
    out["uvaple_lines"] = [ln.strip()[:300] for ln in text.splitlines() if "uvaple" in ln.lower()][:20]
    return out


class Check:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = a.work
        self.runs_dir = os.path.join(self.work, "runs")
        os.makedirs(self.runs_dir, exist_ok=True)
        os.makedirs(a.out, exist_ok=True)
        self.log = Log(os.path.join(a.out, "engine_check.log"))
        self.t_end = time.monotonic() + a.deadline_s
        self.logging_config = logging_config(os.path.join(self.work, "logging.json"))
        self.cache_root = os.path.join(self.work, "vllm_cache")
        self.result_path = os.path.join(a.out, "engine_check.json")
        self.state_path = os.path.join(self.work, "engine_check.json")
        self.res: dict = json.load(open(self.state_path)) if os.path.exists(self.state_path) else {}
        calls = self.res.setdefault("calls", [])
        if calls and self.res.get("blocker"):  # an earlier call's blocker stays with that call
            calls[-1]["blocker"] = self.res["blocker"]
        calls.append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:]})
        self.res["blocker"] = None
        self.res["notes"] = []

    # ------------------------------------------------------------------ bookkeeping
    def left(self) -> float:
        return self.t_end - time.monotonic()

    def save(self) -> None:
        self.res["summary"] = self.summary()
        text = json.dumps(self.res, indent=1, default=str)
        for p in (self.state_path, self.result_path):
            with open(p + ".tmp", "w") as f:
                f.write(text)
            os.replace(p + ".tmp", p)

    def note(self, msg: str) -> None:
        if msg not in self.res["notes"]:
            self.res["notes"].append(msg)
        self.log(msg)

    def block(self, where: str, call: str, error: str, log_tail: str | None = None) -> None:
        """The first failure of this call that the plugin cannot change: where, the call, the error."""
        if self.res.get("blocker") is None:
            self.res["blocker"] = {"where": where, "call": call, "error": error, "log_tail": log_tail}
        last = [ln for ln in (error or "").splitlines() if ln.strip()]
        self.log(f"BLOCKER at {where}: {last[-1] if last else ''}")

    # ------------------------------------------------------------------ runs of an earlier lease
    def resume(self, src: str) -> None:
        """Take the run results in ``src`` (an earlier call's ``runs/``, brought back and committed) as done, where
        they served this call's checkpoint (the same digest) on this call's GPU model and were not stopped at their
        time limit. Engines on two GPU models need not agree to the bit (their kernels and tile choices differ), so a
        comparison never mixes them. A run that does not name its GPU takes the one its call's ``engine_check.json``
        (beside ``src``) names, or none."""
        taken, other, other_gpu = [], [], []
        gpu = self.res.get("env", {}).get("gpu")
        call_gpu = None
        try:
            call_gpu = json.load(open(os.path.join(src, os.pardir, "engine_check.json"))).get("env", {}).get("gpu")
        except (OSError, ValueError, AttributeError):
            pass
        names = sorted(f for f in os.listdir(src) if f.endswith(".json") and not f.endswith(".spec.json"))
        for name in names:
            dst = os.path.join(self.runs_dir, name)
            try:
                res = json.load(open(os.path.join(src, name)))
            except ValueError:
                continue
            spec = res.get("spec") or {}
            if f"{spec.get('key')}.json" != name:
                continue  # not a run's result
            want = self.res.get("checkpoints", {}).get(spec.get("model"), {}).get("digest")
            if want is None or spec.get("ckpt_digest") != want or res.get("stage") == "timeout":
                other.append(spec["key"])
                continue
            if gpu is None or spec.get("gpu", call_gpu) != gpu:
                other_gpu.append(spec["key"])
                continue
            if not os.path.exists(dst) or self.a.force:
                spec["gpu"] = gpu  # the copy keeps where it ran, whatever call's folder it is committed in next
                res.setdefault("resumed_from", src)
                with open(dst, "w") as f:
                    json.dump(res, f, indent=1)
                self.res.setdefault("runs", {})[spec["key"]] = dict(_brief(res), resumed_from=src)
                taken.append(spec["key"])
        left = f"; left {len(other)} of another checkpoint or stopped at their time limit: {', '.join(other)}"
        elsewhere = f"; left {len(other_gpu)} run on another GPU than this call's {gpu}: {', '.join(other_gpu)}"
        self.note(f"resumed {len(taken)} runs from {src}" + (left if other else "") + (elsewhere if other_gpu else ""))

    # ------------------------------------------------------------------ env
    def env(self) -> None:
        code = r"""
import importlib.metadata as md, json, sys, torch
out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for m in ("triton", "transformers", "vllm", "uvaple", "openai", "xgrammar", "torchvision", "timm"):
    try:
        out[m] = md.version(m)
    except md.PackageNotFoundError:
        out[m] = None
import vllm
out["vllm_file"] = vllm.__file__
eps = [e for e in md.entry_points(group="vllm.general_plugins")]
out["plugins"] = {e.name: e.value for e in eps}
from packaging.requirements import Requirement
bad = []
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        v = md.version(req.name)
    except md.PackageNotFoundError:
        bad.append(f"{req.name}: missing"); continue
    if req.specifier and not req.specifier.contains(v, prereleases=True):
        bad.append(f"{req.name} {v} (wants {req.specifier})")
out["requirements_unmet"] = bad
try:
    import vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch  # noqa
    from vllm import _custom_ops as ops
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ops.rms_norm(y, x, w, 1e-6)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)
    out["rms_norm_max_err"] = float((y.float() - ref.float()).abs().max())
except Exception as e:
    out["extension_error"] = f"{type(e).__name__}: {e}"
try:
    import vllm._qutlass_C  # noqa
    out["qutlass"] = "imported"
except Exception as e:
    out["qutlass"] = f"{type(e).__name__}: {str(e)[:200]}"
print("ENV" + json.dumps(out))
"""
        try:
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as e:
            r = subprocess.CompletedProcess(e.cmd, 124, str(e.stdout or ""), f"no answer in 300 s: {e}")
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("ENV")), None)
        if line is None:
            err = (r.stderr or r.stdout)[-3000:]
            self.res["env"] = {"error": err}
            self.block("env: import vllm", f"{sys.executable} -c 'import vllm ...'", err)
            return
        env = json.loads(line[3:])
        self.res["env"] = env
        self.log(f"env: Python {env['python']}, torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, "
                 f"transformers {env['transformers']}, vLLM {env['vllm']} ({env['vllm_file']}), uvaple "
                 f"{env['uvaple']}, GPU {env['gpu']}")
        self.log(f"env: plugins {env['plugins']}; rms_norm max error {env.get('rms_norm_max_err')}; "
                 f"extension error {env.get('extension_error')}; _qutlass_C: {env['qutlass']}")
        self.log(f"env: vLLM requirements not met as pinned ({len(env['requirements_unmet'])}): "
                 f"{', '.join(env['requirements_unmet'][:40])}")
        if "uvaple" not in env["plugins"]:
            self.block("env: plugin discovery", "importlib.metadata.entry_points(group='vllm.general_plugins')",
                       "the uvaple entry point is not installed (pip install -e . first)")
        if env.get("extension_error"):
            self.block("env: vLLM's extensions on the GPU", "vllm._custom_ops.rms_norm", env["extension_error"])

    # ------------------------------------------------------------------ runs
    def run_key(self, model: str, mode: str, config: str, level: str) -> str:
        return f"{model}.{mode}{'' if mode == 'eager' else '-' + level}.{config}"

    def spec(self, model: str, mode: str, config: str, level: str, compilation) -> dict:
        key = self.run_key(model, mode, config, level)
        seg = "ec" + hashlib.sha256(f"{key}{time.time()}".encode()).hexdigest()[:10]
        return {"key": key, "model": model, "mode": mode, "config": config, "level": level,
                "ckpt_digest": self.res.get("checkpoints", {}).get(model, {}).get("digest"),
                "gpu": self.res.get("env", {}).get("gpu"), "compilation": compilation, "segment": seg,
                "expect": CONFIGS[config].get("expect", {}).get(mode),
                "ckpt": os.path.join(self.work, "ckpt", model), "logging_config": self.logging_config,
                "hot_profile": os.path.join(self.work, "ckpt", model, "hot_profile.txt"),
                # one compile cache per model and configuration: engines that start side by side never write the
                # same one
                "cache_root": os.path.join(self.cache_root, f"{model}-{config}"),
                "result": os.path.join(self.runs_dir, key + ".json"),
                "log": os.path.join(self.runs_dir, key + ".log")}

    def launch(self, specs: list[dict], timeout: float) -> list[dict]:
        """Start the runs side by side, wait (bounded), collect their results and what they left."""
        procs = []
        for s in specs:
            path = os.path.join(self.runs_dir, s["key"] + ".spec.json")
            json.dump(s, open(path, "w"), indent=1)
            for p in (s["result"], s["log"]):
                if os.path.exists(p):
                    os.remove(p)
            f = open(s["log"], "w")
            procs.append((s, subprocess.Popen([sys.executable, HERE, "--child", path], stdout=f,
                                              stderr=subprocess.STDOUT, env=child_env(s), start_new_session=True), f))
            self.log(f"run {s['key']}: started")
        deadline = time.monotonic() + timeout
        results = []
        for s, p, f in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"run {s['key']}: no result in {timeout:.0f} s: killed")
            _kill_group(p)
            f.close()
            res = json.load(open(s["result"])) if os.path.exists(s["result"]) else {
                "spec": {k: v for k, v in s.items() if k != "logging_config"}, "ok": False, "stage": "timeout",
                "error": f"no result within {timeout:.0f} s (killed)", "call": "vllm.LLM(" + ", ".join(
                    f"{k}={v!r}" for k, v in engine_kwargs(s).items()) + ")"}
            res.update(parse_log(s["log"]))
            res["log_tail"] = _tail(s["log"], 40) if not res.get("ok") else None
            if CONFIGS[s["config"]].get("uvaple") is not None:
                res["segments_left"] = segments_left(s["segment"])
            if s["mode"] == "graph":  # what vLLM compiled, beside the run's result (runs/<key>.graphs/)
                res["graphs_kept"] = keep_graphs(s["cache_root"], os.path.join(self.runs_dir, s["key"] + ".graphs"))
            with open(s["result"], "w") as out:
                json.dump(res, out, indent=1)
            self.res.setdefault("runs", {})[s["key"]] = _brief(res)
            state = "ok" if res.get("ok") else f"FAILED at {res.get('stage')}: {res.get('error', '')[:300]}"
            self.log(f"run {s['key']}: {state}; weights {res.get('weights_gib')} GiB, KV cache "
                     f"{res.get('kv_cache_gib')} GiB ({res.get('num_gpu_blocks')} blocks), init {res.get('init_s')} s")
            results.append(res)
        self.save()
        return results

    def done(self, key: str) -> dict | None:
        """The run's result from an earlier call (a failure is a result too, but for one stopped at its time
        limit: it had no fair chance); None: run it."""
        path = os.path.join(self.runs_dir, key + ".json")
        if self.a.force or not os.path.exists(path):
            return None
        res = json.load(open(path))
        return None if res.get("stage") == "timeout" else res

    def tokens(self, model: str) -> bool | None:
        """The token comparison of ``model``; False where nothing ran in eager mode (vLLM did not start), None
        where the time left could not hold the next group (the next call continues)."""
        for mode in [m for m in MODES if m in self.a.modes]:
            configs = [c for c in CONFIGS if c in self.a.configs and applies(c, model, mode)]
            levels = ([(lv, GRAPH_LEVELS[lv]) for lv in self.a.graph_levels] if mode == "graph"
                      else [("eager", None)])
            for level, compilation in levels:
                todo = [c for c in configs if not self.done(self.run_key(model, mode, c, level))
                        and not (level in INPROC_LEVELS and CONFIGS[c].get("inproc"))]  # in process already
                need = group_need(mode, self.res.get("group_s", {}).get(mode))
                if todo and self.left() < need:
                    self.note(f"{model} {mode}: skipped, {self.left():.0f} s left (a group needs ~{need} s); "
                              "the next call continues")
                    return None
                # a few at a time: twelve side by side on 16 cores did not start within 240 s on the H200
                for i in range(0, len(todo), self.a.parallel):
                    group = todo[i:i + self.a.parallel]
                    if self.left() < need:
                        self.note(f"{model} {mode}: {', '.join(todo[i:])} skipped, {self.left():.0f} s left; the next "
                                  "call continues")
                        return None
                    self.log(f"{model} {mode} ({level}): {', '.join(group)} side by side, kv_cache_memory_bytes "
                             f"{KV_CACHE_BYTES / GIB:g} GiB each")
                    t0 = time.monotonic()
                    self.launch([self.spec(model, mode, c, level, compilation) for c in group],
                                timeout=min(self.left() - 10, 420 if mode == "graph" else 300))
                    seen = self.res.setdefault("group_s", {})
                    seen[mode] = round(max(seen.get(mode, 0.0), time.monotonic() - t0), 1)
                    need = group_need(mode, seen[mode])
                runs = {}
                for c in configs:
                    path = os.path.join(self.runs_dir, self.run_key(model, mode, c, level) + ".json")
                    if os.path.exists(path):
                        runs[c] = json.load(open(path))
                self.compare(model, mode, level, runs)
                ok = [c for c, r in runs.items() if r.get("ok")]
                if not ok and runs:
                    first = runs.get("hbm") or next(iter(runs.values()))
                    self.block(f"{model} {mode} ({level}): every configuration failed at {first.get('stage')}",
                               first.get("call", ""), first.get("error", ""), first.get("log_tail"))
                    if mode == "eager":
                        return False
        return True

    def compare(self, model: str, mode: str, level: str, runs: dict) -> None:
        table = self.res.setdefault("tokens", {}).setdefault(model, {})
        entry = {"level": level, "configs": {}}
        for c, r in runs.items():
            row = {"ok": bool(r.get("ok")), "weights_gib": r.get("weights_gib"), "init_s": r.get("init_s"),
                   "segments": [{k: s.get(k) for k in ("name", "table_bytes", "size_bytes", "state", "pids")}
                                for s in r.get("segments", []) or []],
                   "segments_left": [s.get("name", s) for s in r.get("segments_left", []) or []],
                   "placement_lines": r.get("placement_lines", [])[:3]}
            expect = CONFIGS[c].get("expect", {}).get(mode)
            if expect is not None:  # the engine must stop at start-up with the named error
                row["refused_as_expected"] = refused(r, expect)
                row["expected_error"] = expect
                entry["configs"][c] = row
                if not row["refused_as_expected"]:
                    self.log(f"{model} {mode} {c}: expected the named error {expect!r}; got "
                             f"{'a running engine' if r.get('ok') else str(r.get('error'))[:300]}")
                continue
            if r.get("ok") and CONFIGS[c].get("uvaple") is not None:  # the table once: one segment per PLE table
                want = self.res.get("checkpoints", {}).get(model, {})
                segs = r.get("segments") or []
                row["table_once"] = len(segs) == want.get("ple_tables")
            ref_name = reference(c)
            ref = runs.get(ref_name)
            if not r.get("ok"):
                row["error"] = (r.get("stage"), (r.get("error") or "")[:500])
            elif c != ref_name and ref is not None and ref.get("ok"):
                row["reference"] = ref_name
                row.update(_diff(ref, r))
            entry["configs"][c] = row
            if row.get("identical") is False:
                where = row.get("first_difference") or "tokens identical where both have them"
                self.log(f"{model} {mode} {c} against {ref_name}: {_verdict(c, row)}; first differing token: {where}")
        entry["repeats"] = {f"{c} vs {c}_again": _diff(runs[c], runs[c + "_again"]) for c in ("hbm", "copy", "uva")
                            if runs.get(c, {}).get("ok") and runs.get(c + "_again", {}).get("ok")}
        if runs.get("hbm", {}).get("ok") and runs.get("copy_again", {}).get("ok"):
            entry["repeats"]["hbm vs copy_again"] = _diff(runs["hbm"], runs["copy_again"])
        table[mode if level in ("eager", "default") else f"{mode}-{level}"] = entry  # "graph", "graph-inproc"
        same = [c for c, r in entry["configs"].items() if r.get("identical")]
        self.log(f"{model} {mode} ({level}): identical to their reference (tokens and logprobs): {same or 'none'}; "
                 f"refused as expected: {[c for c, r in entry['configs'].items() if r.get('refused_as_expected')]}; "
                 f"failed: {[c for c, r in entry['configs'].items() if not r['ok'] and 'expected_error' not in r]}; "
                 f"repeats: {json.dumps(entry['repeats'], default=str)[:600]}")
        self.save()

    # ------------------------------------------------------------------ serve
    # First a server with a bad setting, which must exit by itself as vLLM builds the engine's config (the
    # plugin's check runs inside vLLM's per-architecture check: seconds after vLLM's imports; 91 s on the H100
    # when the error came as the engine core built the model). Then a server's start (API process, engine core,
    # model, KV cache; ~80 s eager on the H100) within its /health wait, its checks (a completion, /metrics:
    # bounded at 60 s each) and its stop (at most 30 s after SIGINT, 10 after SIGTERM, 10 after SIGKILL, 15 for
    # its group). Each waits for a call of its own if the time left does not hold it.
    SERVE_HEALTH_WAIT_S = 180
    SERVE_NEEDS_S = SERVE_HEALTH_WAIT_S + 130
    BAD_SETTING_WAIT_S = 120
    BAD_SETTING_NEEDS_S = BAD_SETTING_WAIT_S + 20

    def serve(self) -> None:
        out = self.res.setdefault("serve", {"model": self.a.serve_model, "ok": False})
        if out.get("bad_setting_refused") is not True or self.a.force:  # not yet determined, or not refused
            if self.left() < self.BAD_SETTING_NEEDS_S:
                self.note(f"serve with a bad setting: skipped, {self.left():.0f} s left (it needs "
                          f"~{self.BAD_SETTING_NEEDS_S} s); the next call continues")
                return
            spec = self.spec(out["model"], "eager", "uva", "eager", None)
            out["bad_setting"] = self._serve_refuses(spec, self._serve_env(spec))
            out["bad_setting_refused"] = out["bad_setting"]["refused"]
            self.save()
        if not out.get("ok") or self.a.force:
            if self.left() < self.SERVE_NEEDS_S:
                self.note(f"serve: skipped, {self.left():.0f} s left (it needs ~{self.SERVE_NEEDS_S} s); the next "
                          "call continues")
                return
            self._serve_good()

    def _new_serve_record(self, model: str) -> dict:
        """The serve record, emptied for a good server's run but for the bad setting's step (an earlier one's)."""
        out = self.res["serve"]
        bad = {k: out[k] for k in ("bad_setting", "bad_setting_refused") if k in out}
        out.clear()
        out.update(bad, model=model, ok=False)
        return out

    def _serve_env(self, spec: dict) -> dict:
        # vLLM's own process layout (the API server, then the engine core): its engine pushes into the directory
        env = dict(child_env(spec), PROMETHEUS_MULTIPROC_DIR=os.path.join(self.work, "prometheus"))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        return env

    def _serve_good(self) -> None:
        import socket

        model = self.a.serve_model
        spec = self.spec(model, "eager", "uva", "eager", None)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = self._serve_env(spec)
        prom = env["PROMETHEUS_MULTIPROC_DIR"]
        if os.path.isdir(prom):
            for f in os.listdir(prom):
                os.remove(os.path.join(prom, f))
        os.makedirs(prom, exist_ok=True)
        out = self._new_serve_record(model)
        cmd = serve_cmd(spec, port, {"placement": "uva", "segment": spec["segment"], "metrics_interval_s": 1})
        out["cmd"] = " ".join(cmd)
        log_path = os.path.join(self.runs_dir, "serve.log")
        f = open(log_path, "w")
        self.log(f"serve: {out['cmd']}")
        p = start_server(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            t0 = time.monotonic()
            # The whole wait, whatever the deadline: a server cut short says nothing about serving.
            while time.monotonic() - t0 < self.SERVE_HEALTH_WAIT_S:
                if p.poll() is not None:
                    raise RuntimeError(f"the server exited with {p.returncode} before /health answered")
                if _http(base + "/health", timeout=2)[0] == 200:
                    break
                time.sleep(1)
            else:
                raise RuntimeError(f"no /health 200 within {self.SERVE_HEALTH_WAIT_S} s")
            out["startup_s"] = round(time.monotonic() - t0, 1)
            out["segments"] = shm_list(spec["segment"])
            prompt = prompts()[0]
            out["completion"] = _complete(base, model, prompt)
            ref = self._offline_text(model)
            if ref is not None:
                out["same_text_as_offline_uva_eager"] = out["completion"].get("text") == ref
            else:
                self.note(f"serve: no offline uva engine of {model} in this WORK to compare the completion with "
                          f"(--models {model} --modes eager --configs uva in this call or an earlier one)")
            time.sleep(3)  # two metrics pushes
            code, body = _http(base + "/metrics", timeout=10)
            lines = [ln for ln in body.splitlines() if ln.startswith("uvaple_")]
            out["metrics_status"] = code
            out["uvaple_series"] = sorted({ln.split("{")[0].split(" ")[0] for ln in lines})
            out["uvaple_metrics_sample"] = lines[:12]
            out["ok"] = bool(out["completion"].get("text") is not None)
        except Exception as e:  # noqa: BLE001 - a failed serve is a result
            out["error"] = f"{type(e).__name__}: {e}"
            out["log_tail"] = _tail(log_path, 60)
        finally:
            out["stop"] = _stop_server(p)
            f.close()
            time.sleep(1.0)
            try:
                out["segments_left"] = [x.get("name") for x in shm_list(spec["segment"])]
            except Exception as e:  # noqa: BLE001 - the record is kept whatever listing says
                out["segments_left"] = None
                out["segments_error"] = f"{type(e).__name__}: {e}"
            out.update({k: v for k, v in parse_log(log_path).items() if k in ("placement_lines", "uvaple_lines",
                                                                                "kv_cache_gib", "weights_gib")})
        self.log(f"serve: ok={out['ok']}; completion {str(out.get('completion'))[:200]}; uvaple series "
                 f"{out.get('uvaple_series')}; stopped {out['stop']}; segments left {out.get('segments_left')}; "
                 f"error {out.get('error')}")
        self.save()  # before the bad setting's server: a call cut short there keeps this one's record

    def _serve_refuses(self, spec: dict, env: dict) -> dict:
        """``vllm serve`` with a bad ``uvaple`` setting: it must exit, bounded, with the named error."""
        cmd = serve_cmd(spec, 0, {"placement": "gpu", "segment": spec["segment"]})
        log_path = os.path.join(self.runs_dir, "serve_bad_setting.log")
        t0 = time.monotonic()
        wait_s = min(float(self.BAD_SETTING_WAIT_S), self.left() - 20)
        with open(log_path, "w") as f:
            p = start_server(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            try:
                code = p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                code = None
            _kill_group(p)
        text = open(log_path, errors="replace").read()
        named = _names_the_bad_placement(text)
        # refused: exited with the named error; None: still starting when the wait ended (not determined: the next
        # call tries again); False: it exited otherwise, or served
        refused = None if code is None else bool(code != 0 and named)
        res = {"cmd": " ".join(cmd), "exit_status": code, "seconds": round(time.monotonic() - t0, 1),
               "wait_s": round(wait_s, 1), "named_error": named, "refused": refused,
               "error_lines": [ln.strip()[:300] for ln in text.splitlines()
                               if "PluginConfigError" in ln or '"uvaple".' in ln][:3]}
        self.log(f"serve with a bad setting: exit {code} after {res['seconds']} s (of {wait_s:.0f} s), named error: "
                 f"{named}" + ("; not determined: still starting when the wait ended" if refused is None else ""))
        return res

    def _offline_text(self, model: str) -> str | None:
        path = os.path.join(self.runs_dir, self.run_key(model, "eager", "uva", "eager") + ".json")
        if not os.path.exists(path):
            return None
        r = json.load(open(path))
        return r["texts"][0] if r.get("ok") else None

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        s = {"blocker": self.res.get("blocker")}
        for model, modes in self.res.get("tokens", {}).items():
            for mode, entry in modes.items():
                s[f"{model}.{mode}"] = {c: _verdict(c, r) for c, r in entry["configs"].items()}
                if entry.get("repeats"):
                    s[f"{model}.{mode}.repeats"] = {k: ("identical" if v.get("identical") else
                                                        f"{v.get('logprobs_differing')} of {v.get('logprobs_compared')}"
                                                        f" logprobs differ (max {v.get('max_logprob_difference'):.3g})"
                                                        f"{'' if v.get('tokens_identical') else ', tokens differ'}")
                                                    for k, v in entry["repeats"].items()}
        if "serve" in self.res:
            sv = self.res["serve"]
            s["serve"] = {k: sv.get(k) for k in ("ok", "same_text_as_offline_uva_eager", "uvaple_series",
                                                 "bad_setting_refused", "segments_left", "error")}
        return s

    def main(self) -> int:
        a = self.a
        self.log(f"engine_check: models {a.models}, modes {a.modes}, configs {a.configs}, phases {a.only}, "
                 f"{a.deadline_s:.0f} s")
        try:
            self.res["checkpoints"] = checkpoints(self.work, a.models, self.log)
        except Exception as e:  # noqa: BLE001
            self.block("checkpoints (transformers)", "engine_check.checkpoints", traceback.format_exc()[-3000:])
            self.log(f"checkpoints failed: {e}")
            self.save()
            return 1
        if a.checkpoints_only:
            self.save()
            return 0
        self.env()
        if a.resume:
            self.resume(a.resume)
        self.save()
        if self.res.get("blocker"):
            return 1
        for model in a.models:
            started = self.tokens(model) if "tokens" in a.only else True
            if started is None:
                break
            if not started:  # a blocker of this model's (the next model may not share it)
                self.note(f"{model}: vLLM's engine did not start in eager mode with any placement (the failure "
                          "above); nothing more is run for it")
                continue
            if "serve" in a.only and model == a.serve_model:
                self.serve()
        self.save()
        self.log(f"summary: {json.dumps(self.summary(), default=str)[:3000]}")
        return 0


# ============================================================================================== helpers
def serve_cmd(spec: dict, port: int, uvaple: dict) -> list[str]:
    """``vllm serve`` for ``spec``'s model, eager, with the plugin's ``uvaple`` settings."""
    add = {"uvaple": uvaple}
    if spec["model"] in QWEN:
        add["gdn_prefill_backend"] = "triton"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", spec["ckpt"], "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--gpu-memory-utilization", str(GPU_UTIL),
           "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager", "--attention-backend", "TRITON_ATTN",
           "--seed", "0", "--served-model-name", spec["model"], "--additional-config", json.dumps(add)]
    if spec["model"] == "gemma3n":
        cmd += ["--limit-mm-per-prompt", json.dumps({"image": 0, "audio": 0}), "--enable-mm-embeds"]
    return cmd


def _names_the_bad_placement(log_text: str) -> bool:
    """Whether a server's log names the plugin's refusal of ``placement: gpu``: raised as the model is built
    (``PluginConfigError``), or as vLLM builds its config (pydantic's ``validation error for VllmConfig``
    carrying the plugin's message)."""
    return ("PluginConfigError" in log_text or "validation error for VllmConfig" in log_text) and \
        '"uvaple".placement: expected one of' in log_text


#: run before a server's command: SIGINT back to its default, then the command (a process started from a background
#: job, or under nohup, inherits SIGINT ignored, and an ignored signal stays ignored across exec: the server would
#: then never see the Ctrl-C that stops it)
_SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execvp(sys.argv[1], sys.argv[1:])")


def start_server(cmd: list[str], **popen) -> subprocess.Popen:
    """``cmd`` in a process group of its own, SIGINT at its default whatever this process's is (see
    :data:`_SIGINT_DEFAULT`); ``popen``: Popen's other arguments."""
    return subprocess.Popen([sys.executable, "-c", _SIGINT_DEFAULT, *cmd], start_new_session=True, **popen)


def _stop_server(p: subprocess.Popen, sigint_wait_s: float = 30.0, group_wait_s: float = 15.0) -> dict:
    """Stop a server as Ctrl-C does (SIGINT to its process group), then SIGTERM, then SIGKILL; say which one did,
    and whether a process of its group (the engine core) outlived it and was killed.

    A process stopped by SIGKILL cannot unlink its shared segments (the next start attaches them, ``uvaple shm
    clean`` removes them), so the record tells a segment left by a kill from one left by a clean stop.
    """
    t0 = time.monotonic()
    rec: dict = {"by": "not stopped"}
    if p.poll() is not None:
        rec = {"by": "exited by itself"}
    else:
        for sig, wait_s in ((signal.SIGINT, sigint_wait_s), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:  # exited between the poll and the signal
                rec = {"by": "exited by itself"}
                break
            except PermissionError:
                break
            try:
                p.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            rec = {"by": sig.name}
            break
    if p.poll() is not None:
        # the group's other processes (the engine core) end after the server; a straggler is killed and said
        stragglers = not _group_gone(p.pid, group_wait_s)
        if stragglers:
            _kill_group(p)
        rec["group_killed_after"] = stragglers
    rec.update(seconds=round(time.monotonic() - t0, 1), exit_status=p.poll())
    return rec


def _group_alive(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (``/proc``; a zombie, ended and not yet reaped, does not)."""
    alive = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold anything
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":  # state, ppid, pgrp
            alive.append(int(d))
    return alive


def _group_gone(pgid: int, wait_s: float) -> bool:
    """Whether every process of group ``pgid`` has ended (zombies count as ended), waiting up to ``wait_s``."""
    t_end = time.monotonic() + wait_s
    while _group_alive(pgid):
        if time.monotonic() >= t_end:
            return False
        time.sleep(0.2)
    return True


def _kill_group(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(0.5)


def _tail(path: str, n: int) -> str:
    if not os.path.exists(path):
        return ""
    return "\n".join(open(path, errors="replace").read().splitlines()[-n:])


def _diff(ref: dict, r: dict) -> dict:
    """``r`` against ``ref``: ``identical`` (the same tokens and every top-2 logprob equal), where the tokens first
    differ and how close the reference's top two were there, and the logprobs compared (up to each prompt's first
    differing token): how many, how many differ, the largest difference."""
    a, b = ref.get("tokens") or [], r.get("tokens") or []
    la, lb = ref.get("top2") or [[]] * len(a), r.get("top2") or [[]] * len(b)
    out: dict = {"tokens_identical": len(a) == len(b) and len(a) > 0 and a == b}
    compared = differ = 0
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        j = next((k for k, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        if j < min(len(x), len(y)) and "first_difference" not in out:
            top = la[i] if i < len(la) else []
            margin = round(top[j][0] - top[j][1], 6) if j < len(top) and len(top[j]) == 2 else None
            out["first_difference"] = {"prompt": i, "step": j, "reference": x[j:j + 4], "this": y[j:j + 4],
                                       "reference_top2_margin": margin}
        for p, q in zip(la[i][:j + 1] if i < len(la) else [], lb[i][:j + 1] if i < len(lb) else [], strict=False):
            for u, v in zip(p, q, strict=False):
                compared += 1
                if u != v:
                    differ += 1
                    worst = max(worst, abs(u - v))
    out.update(logprobs_compared=compared, logprobs_differing=differ, max_logprob_difference=worst)
    out["identical"] = out["tokens_identical"] and compared > 0 and differ == 0
    return out


def refused(run: dict, expect: str) -> bool:
    """Whether ``run``'s engine stopped at start-up with the named error ``expect``: in the error ``LLM()`` raised
    (an engine in this process), or in the log's plugin lines, where an engine core started in its own process
    printed it before ``LLM()`` raised vLLM's "Engine core initialization failed"."""
    if run.get("ok"):
        return False
    text = "\n".join(str(x) for x in (run.get("error"), run.get("log_tail"), run.get("error_lines"),
                                      *(run.get("uvaple_lines") or ())))
    return expect in text


def _verdict(config: str, row: dict) -> str:
    if "expected_error" in row:
        return "refused as expected" if row.get("refused_as_expected") else "NOT REFUSED AS EXPECTED"
    if not row.get("ok"):
        return "failed"
    if "reference" not in row:
        return "reference"
    if row.get("identical"):
        return "identical"
    if row.get("tokens_identical"):
        return f"same tokens, {row.get('logprobs_differing')} of {row.get('logprobs_compared')} logprobs differ"
    return "DIFFERENT tokens"


def _brief(res: dict) -> dict:
    return {k: res.get(k) for k in ("ok", "stage", "error", "init_s", "weights_gib", "kv_cache_gib", "num_gpu_blocks",
                                    "compilation", "call")}


def _http(url: str, data: bytes | None = None, timeout: float = 10) -> tuple[int, str]:
    import urllib.request

    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001
        return getattr(e, "code", 0) or 0, str(e)


def _complete(base: str, model: str, prompt: str) -> dict:
    """One greedy completion through the OpenAI client (plain HTTP when the client does not import)."""
    try:
        from openai import OpenAI

        client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60.0, max_retries=0)
        r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        return {"via": "openai", "text": r.choices[0].text, "usage": r.usage.model_dump() if r.usage else None}
    except Exception as e:  # noqa: BLE001
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                           "ignore_eos": True}).encode()
        code, text = _http(base + "/v1/completions", data=body, timeout=60)
        try:
            return {"via": "http", "openai_error": f"{type(e).__name__}: {e}"[:300],
                    "text": json.loads(text)["choices"][0]["text"], "status": code}
        except (ValueError, KeyError, IndexError):
            return {"via": "http", "openai_error": f"{type(e).__name__}: {e}"[:300], "status": code,
                    "text": None, "body": text[:500]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="engine-check-out", help="engine_check.json and engine_check.log go here")
    p.add_argument("--work", default="/tmp/vllm_engine", help="checkpoints, run logs and results (kept)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--configs", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS))
    p.add_argument("--only", default=",".join(PHASES), help="phases: tokens, serve")
    p.add_argument("--graph-levels", default="default",
                   help="graph mode's levels, of " + ", ".join(GRAPH_LEVELS) + " (inproc: the engine core in the "
                   "run's own process, every prompt queued before the first step)")
    p.add_argument("--serve-model", default="qwen4exp_bf16", help="the model vllm serve runs (phase serve)")
    p.add_argument("--parallel", type=int, default=4, help="engines started side by side")
    p.add_argument("--deadline-s", type=float, default=480.0, help="stop starting runs after this long")
    p.add_argument("--checkpoints-only", action="store_true", help="build the checkpoints and stop (CPU)")
    p.add_argument("--force", action="store_true", help="repeat runs already done")
    p.add_argument("--resume", help="a folder of an earlier call's run results (runs/*.json, e.g. committed under "
                   "perf/results/): those of the same checkpoints count as done")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return run_child(a.child)
    for name, allowed in (("models", MODELS), ("modes", MODES), ("configs", CONFIGS), ("only", PHASES),
                          ("graph_levels", GRAPH_LEVELS)):
        vals = [v for v in getattr(a, name).split(",") if v]
        bad = [v for v in vals if v not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: {bad} not in {list(allowed)}")
        setattr(a, name, vals)
    if a.parallel < 1:
        p.error(f"--parallel: at least 1 engine at a time, got {a.parallel}")
    a.out, a.work = os.path.abspath(a.out), os.path.abspath(a.work)
    if a.resume is not None and not os.path.isdir(a.resume):
        p.error(f"--resume {a.resume}: not a folder (give the runs/ folder of an earlier call's results)")
    os.makedirs(a.work, exist_ok=True)
    return Check(a).main()


if __name__ == "__main__":
    sys.exit(main())
