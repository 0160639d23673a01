"""What does the plugin cost per decode token in vLLM's engine, against HBM and against vLLM's own host path?

``python3 perf/vllm_carry/decode_bench.py --out DIR [--model qwen4exp|gemma3n]
[--configs hbm,uva,host,uva_fp8row,device] [--batches 1,8,32,64] [--engine-batches ...] [--prompt 512]
[--decode 256] [--reps 5] [--reps-batch1 15]
[--table-gib 24] [--layers fit] [--experts 512] [--profile BATCH] [--profile-tokens 48] [--cpus 0-7]
[--work /tmp/vllm_decode] [--deadline-s 540] [--plan]``

Runs on a GPU machine with vLLM 0.33 (on the lent H200: carried, ``perf/gpu_check.sh vllm_decode``); ``--plan``
prints the model, the sizes and the engine calls and exits (any machine). Refuses to start without CUDA.

The model: Qwen4Exp (``Qwen4ExpForCausalLM``) at the deployed model's dimensions, random weights
(``load_format="dummy"``: only its ``config.json`` is written; no tokenizer, the prompts are token ids).
transformers' ``Qwen4ExpTextConfig`` defaults, with what vLLM's own tuned GEMM plans for "Qwen3.8-Flash-Next"
show of the served model (``vllm/models/qwen4_exp/nvidia/low_latency_gemm.py``, ``ops/cute_dsl/hc_down_silu.py``):
hidden 2,560 (the HC down projection's K = 4 x 2,560 = 10,240, N = 320 + 4), 512 experts (the router 512 x
2,560), shared expert 640, gated delta net of 16 key and 48 value heads of 128 (QKVZ 16,384 and output 6,144 at
TP = 1), attention of 24 query and 2 KV heads of 256 (the fused QKV/gate 6,656 at TP = 2); top-10 experts of
512 and the vocabulary of 248,320 as transformers' defaults. One PLE layer (layer 1; ``--ple-layer``) of 16 n-gram
heads x 160 values (``ple_embed_dim`` 2,560: the 160-B fp8 rows of the field's reports), each head's rows set by
``--table-gib`` of bf16 (24 GiB: 5.03 M a head; the real model's 20 M a head make 95.4 GiB, for which vLLM's own
host path pins the next power of two, 128 GiB, more than the H200 host has). Layers: ``--layers fit`` takes the
most, in whole periods of three gated-delta-net layers and one attention layer, for which the HBM baseline (the
table in HBM) fits on the GPU with the KV cache (the run's GPU; ``--plan`` shows an H200's); experts, widths
and the table stay real. The QSA indexer is left out (its fields unset: vLLM then builds plain attention for
those layers, as ``checkpoints.py`` does).

``--model gemma3n``: Gemma 3n E4B as vLLM serves it (``Gemma3nForConditionalGeneration``, the class a Gemma 3n
checkpoint names: vLLM 0.33's text-only class never reads the per-layer table). Its text model is transformers'
``Gemma3nTextConfig`` defaults (hidden 2,048, 35 layers, MLP 16,384; the per-layer table of 262,144 ids x 35 x
256, 4.4 GiB bf16), the vision and audio towers the defaults' (built, never fed: no image or audio a prompt),
random weights, a word-level tokenizer of its vocabulary and its processor (``write_gemma3n``). vLLM runs its
per-layer lookup eagerly, outside the CUDA graphs (the runner's ``embed_input_ids``), for HBM and the plugin
alike. Its prompts are token ids of a Zipf law (``ZIPF_S``) over the vocabulary, as text's are, so that a hot
set has what to hold (the decoded tokens are the dummy model's own: the law shapes the prefill's lookups);
its configurations: ``hbm`` (vLLM's own table: vLLM has no host path for it), ``uva``, ``uva_hot`` (0.25 GB of
the most frequent rows in HBM, ranked on a profile of the same law drawn apart from the prompts), ``device``,
``uva_dedup``. Its results are kept in ``/tmp/vllm_decode_gemma3n``.

Configurations (``--configs``), one engine each, alone on the GPU, in this order:

* ``hbm``: vLLM without the plugin, ``engram_config={"cpu_offload": False}``: vLLM's device table, the ceiling.
* ``uva``: the plugin, ``{"placement": "uva"}``: rows read from host memory by the gather in the model's stream.
* ``host``: vLLM without the plugin, its default ``engram_config`` (``cpu_offload=True``): the table pinned in
  host memory, read on a side stream started a layer early (with the default ``--ple-layer 1`` its gather is
  started just before the layer loop and joined by the layer's first operation; ``--ple-layer 5`` gives it a
  layer to hide behind), inside the FULL decode graphs.
* ``uva_fp8row``: the plugin, ``{"placement": "uva", "quantize": "fp8_row"}``: half the host bytes.
* ``device``: the plugin, ``{"placement": "device"}``: the plugin's kernel over an HBM copy (kernel vs placement).
* ``uva_dedup``: the plugin, uva with ``dedup`` (prefill calls read each distinct n-gram id once).

Engine: vLLM's defaults (``torch.compile`` and CUDA graphs, FULL_AND_PIECEWISE) with
``cudagraph_capture_sizes`` = the batches, ``max_num_seqs`` = the largest batch, ``max_num_batched_tokens`` =
largest batch x prompt (each batch's prefill is one step: every request then decodes in the same steps),
the same ``kv_cache_memory_bytes`` for every configuration, no prefix caching (a repetition must not find the
last one's KV cache), Triton attention and GDN prefill (FlashAttention and FlashInfer are not carried), and
vLLM's JIT monitor verbose: every Triton or CuTe compile after its warm-up is logged. The compile caches
(``VLLM_CACHE_ROOT``, ``TRITON_CACHE_DIR``) are shared under ``--work``: a later configuration reuses the
kernels an earlier one compiled.

Timing, per batch ``B`` (``--batches``): ``B`` prompts of ``--prompt`` random token ids, greedy, ``ignore_eos``. A
warm-up of the shape first (both calls below, repeated until a pass compiles nothing, at most 4 times); then
``--reps`` times (``--reps-batch1`` at batch 1, default 15: its steps are partly host-bound and spread most): ``T1``
= ``generate(max_tokens=1)`` (time to first token of the batch: its prefill step and one sample, wall clock), then
``generate(max_tokens=N)``, whose requests' engine-core timestamps give the decode step: (last token - first token)
/ (N - 1), the median over the batch's requests (they decode in the same steps). Decode tokens/s = B / step.
Reported per batch: median, min and max over the repetitions; ratios to ``hbm`` and ``host`` from the medians of
this run; the GPU's utilisation while it decoded (NVML, sampled every 20 ms: near 100% means the step is GPU-bound);
lines of vLLM's JIT monitor logged between the timed runs' markers (any is a flaw of that configuration's figures,
flagged in the table). Per configuration: the engine's start (``LLM()`` wall time), host memory taken
(``MemAvailable`` before and after), GPU memory for weights, and the plugin's segments the engine left in
``/dev/shm`` when it stopped (named, then removed: every engine starts with the host memory the first had).

Profile (``--profile B``): after the timings, the engine's worker runs the torch profiler (vLLM's
``profiler_config``, no stacks) over one more ``generate`` of ``--profile-tokens`` tokens at batch ``B``;
``trace_summary.py`` cuts the trace into decode steps at the worker's step annotations and says where each
step's time goes (GPU busy and idle, the longest idle gaps and the kernels either side, the host's step time,
CUDA runtime calls, kernels by time), side by side for the configurations in ``decode_bench.md``. What comes
back: the summary, vLLM's own kernel table of the profile, and the trace cut to what the summary reads
(``profile_CONFIG.json.gz``, when under 4 MiB), also where the summary fails. ``--cpus`` runs every engine
on the same host cores: at batch 1 the GPU works about a third of a step and the engine's host work sets the
rest, and engines the scheduler placed ran the same work up to 1.7 x apart (the median gap between two CUDA
calls of a prefill moved with the whole step). ``--engine-batches`` builds
every engine for the table's batches while timing fewer (``--batches 1 --engine-batches 1,8,32,64 --profile
1``: batch 1 alone, in the engines of the table).

Results: ``DIR/decode_bench.json`` (every repetition), ``DIR/decode_bench.md`` (the table),
``DIR/decode_bench.log`` and each engine's log; saved after every configuration, and a later call continues
where the last one stopped (results kept in ``--work``; ``--force`` repeats them).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from engine_check import Log, _kill_group, _tail, logging_config, segments_left, vllm_env  # noqa: E402 - this folder's
from trace_summary import TraceError, load, save, summarize, trim  # noqa: E402
from trace_summary import markdown as trace_markdown  # noqa: E402

GIB = 1 << 30

#: what the served model's dimensions are (see the module docstring for the evidence of each)
REAL = dict(hidden_size=2560, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=640, linear_num_key_heads=16, linear_num_value_heads=48,
            linear_key_head_dim=128, linear_value_head_dim=128, num_attention_heads=24, num_key_value_heads=2,
            head_dim=256, hc_count=4, hc_lowrank=320, vocab_size=248320, ngram_size=3, heads_per_ngram=8,
            ple_embed_dim=2560, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=512)
PERIOD = 4  # three gated-delta-net layers, then one attention layer (transformers' layer_types)
PLE_LAYER = 1  # the model's 1-based index of its PLE layer (vLLM reads ``ple_layer_ids`` 1-based); --ple-layer

#: configuration -> (the plugin loaded, engram_config or None for vLLM's default, the plugin's settings or None)
CONFIGS = {
    "hbm": (False, {"cpu_offload": False}, None),
    "uva": (True, None, {"placement": "uva"}),
    "host": (False, None, None),
    "uva_fp8row": (True, None, {"placement": "uva", "quantize": "fp8_row"}),
    "device": (True, None, {"placement": "device"}),
    "uva_dedup": (True, None, {"placement": "uva", "dedup": True}),
    "uva_hot": (True, None, {"placement": "uva", "hot_cache_gb": 0.25}),
}
DEFAULT_CONFIGS = ("hbm", "uva", "host", "uva_fp8row", "device")
#: the models (``--model``), what each is, and the configurations that apply to it (and its default ones)
MODELS = {
    "qwen4exp": dict(configs=("hbm", "uva", "host", "uva_fp8row", "device", "uva_dedup"), default=DEFAULT_CONFIGS),
    "gemma3n": dict(configs=("hbm", "uva", "device", "uva_dedup", "uva_hot"), default=("hbm", "uva", "uva_hot")),
}
NOT_FOR = {  # why a configuration does not apply to a model, named when asked for
    ("gemma3n", "host"): "vLLM keeps Gemma 3n's per-layer table in HBM: it has no host path of its own (hbm is "
                         "vLLM's own table)",
    ("qwen4exp", "uva_hot"): "the hot set is of token ids (Gemma 3n's table); an n-gram table's ids are hashes",
    ("gemma3n", "uva_fp8row"): "the plugin quantises Qwen4Exp's n-gram tables only, and refuses fp8_row for "
                               "Gemma 3n's table at start-up",
}
#: Gemma 3n E4B's text model: transformers' ``Gemma3nTextConfig`` defaults (hidden 2,048, 35 layers, MLP 16,384,
#: 8 query and 2 KV heads of 256, KV shared by the last 15 layers; the per-layer table 262,144 ids x 35 x 256)
GEMMA3N = dict(layers=35, hidden=2048, intermediate=16384, vocab=262400, ple_vocab=262144, ple_dim=256,
               q_heads=8, kv_heads=2, head_dim=256)
TRACE_KEEP_BYTES = 4 << 20  # a profile's trace larger than this stays on the GPU machine (results come back small)
KV_CACHE_BYTES = 8 * GIB  # the same for every configuration: the largest batch's KV and GDN state, with room
GPU_GIB = 139.8  # an H200's memory as CUDA reports it (143,771 MiB): --plan's; a run fits its own GPU's
RESERVE_GIB = 14.0  # CUDA context, activations of a prefill step, CUDA graphs, the allocator's slack


def heads() -> int:
    return (REAL["ngram_size"] - 1) * REAL["heads_per_ngram"]


def table_base(table_gib: float) -> int:
    """Rows a head for a bf16 table of at least ``table_gib`` GiB (16 heads x 160 values of 2 bytes)."""
    row_bytes = REAL["ple_embed_dim"] // heads() * 2
    return math.ceil(table_gib * GIB / (heads() * row_bytes))


def layer_bytes(experts: int) -> int:
    """Weight bytes of one decoder layer (bf16), from its widths: experts, shared expert, attention or GDN."""
    h, e, f = REAL["hidden_size"], experts, REAL["moe_intermediate_size"]
    moe = e * 3 * h * f + e * h + 3 * h * REAL["shared_expert_intermediate_size"]
    gdn = h * (2 * REAL["linear_num_key_heads"] * REAL["linear_key_head_dim"] +
               2 * REAL["linear_num_value_heads"] * REAL["linear_value_head_dim"]) + \
        REAL["linear_num_value_heads"] * REAL["linear_value_head_dim"] * h
    c, r = REAL["hc_count"], REAL["hc_lowrank"]
    hc = 2 * (c * h * (r + c) + r * c * h)
    return 2 * (moe + gdn + hc)


def plan_model(table_gib: float, layers: str | int, experts: int, ple_layer: int = PLE_LAYER,
               gpu_gib: float = GPU_GIB) -> dict:
    """The model's sizes; ``layers="fit"``: the most whole periods whose HBM baseline fits on a GPU of
    ``gpu_gib`` (an H200's by default; a run passes its own GPU's); ``ple_layer``: its PLE layer's 1-based
    index (a gated-delta-net layer's, as the served model's)."""
    base = table_base(table_gib)
    table = base * heads() * (REAL["ple_embed_dim"] // heads()) * 2  # about: the primes above base differ a little
    fixed = 2 * 2 * REAL["vocab_size"] * REAL["hidden_size"]  # embedding and LM head
    per_layer = layer_bytes(experts)
    room = (gpu_gib - RESERVE_GIB) * GIB - table - fixed - KV_CACHE_BYTES
    fit = max(PERIOD, int(room // per_layer) // PERIOD * PERIOD)
    n = fit if layers == "fit" else int(layers)
    if n < PLE_LAYER + 1 or n % PERIOD:
        raise ValueError(f"--layers {n}: a multiple of {PERIOD} (three gated-delta-net layers, one attention "
                         "layer)")
    if not 1 <= ple_layer <= n or ple_layer % PERIOD == 0:
        raise ValueError(f"--ple-layer {ple_layer}: a gated-delta-net layer of the {n}, 1-based (not a multiple of "
                         f"{PERIOD}: those are the attention layers)")
    weights = fixed + n * per_layer
    return {"layers": n, "layers_that_fit": fit, "gpu_gib": round(gpu_gib, 1), "experts": experts,
            "ple_layer": ple_layer,
            "ngram_vocab_size_base": base,
            "table_bytes_about": table, "weights_bytes_about": weights,
            "hbm_total_gib_about": round((weights + table + KV_CACHE_BYTES) / GIB, 1)}


ZIPF_S = 1.1  # Gemma 3n's prompts: token ids of a Zipf law over the vocabulary (text's), ranks shuffled once
PROMPT_ID_MIN = 16  # prompts' ids start here: below are the tokenizer's specials (Gemma 3n's media tokens)


def prompt_ids(rng, n: int, vocab: int, zipf: bool) -> list[int]:
    """``n`` prompt token ids in ``[16, vocab)``: uniform, or of a Zipf law (``ZIPF_S``) whose ranks are a fixed
    shuffle of the vocabulary (the same law for every prompt and for the hot set's profile)."""
    import numpy as np

    if not zipf:
        return [rng.randrange(PROMPT_ID_MIN, vocab) for _ in range(n)]
    ranks = _zipf_ranks(vocab)
    g = np.random.default_rng(rng.randrange(1 << 31))
    r = g.zipf(ZIPF_S, size=4 * n)
    r = r[r <= len(ranks)][:n]
    while len(r) < n:  # the law's tail past the vocabulary is drawn again
        more = g.zipf(ZIPF_S, size=4 * n)
        r = np.concatenate([r, more[more <= len(ranks)]])[:n]
    return ranks[r - 1].tolist()


@functools.lru_cache(maxsize=2)
def _zipf_ranks(vocab: int):
    import numpy as np

    return np.random.default_rng(7).permutation(np.arange(PROMPT_ID_MIN, vocab))  # rank r + 1 -> token ranks[r]


def write_hot_profile(path: str, vocab: int, n: int = 1 << 21) -> str:
    """A ``.npy`` of ``n`` token ids of the prompts' law, drawn apart from them: the hot set's ranking."""
    import random

    import numpy as np

    np.save(path, np.asarray(prompt_ids(random.Random(99), n, vocab, True), dtype=np.int64))
    return path


def plan_gemma3n() -> dict:
    """Gemma 3n E4B's text model's sizes (bf16): its per-layer table and the rest of its weights, about."""
    g = GEMMA3N
    table = g["ple_vocab"] * g["layers"] * g["ple_dim"] * 2
    h = g["hidden"]
    attention = h * (g["q_heads"] + 2 * g["kv_heads"]) * g["head_dim"] + g["q_heads"] * g["head_dim"] * h
    per_layer = attention + 3 * h * g["intermediate"] + 2 * h * g["ple_dim"]
    weights = 2 * (g["vocab"] * h + g["layers"] * per_layer + h * g["layers"] * g["ple_dim"])
    return {"model": "gemma3n", "layers": g["layers"], "ple_rows": g["ple_vocab"],
            "ple_row_values": g["layers"] * g["ple_dim"], "table_bytes_about": table, "weights_bytes_about": weights,
            "hbm_total_gib_about": round((weights + table + KV_CACHE_BYTES) / GIB, 1)}


def write_gemma3n(path: str) -> dict:
    """``path``: Gemma 3n E4B as vLLM serves it (``Gemma3nForConditionalGeneration``: the text model of
    transformers' ``Gemma3nTextConfig`` defaults, the default vision and audio towers), no weights (vLLM's dummy
    loader), a word-level tokenizer of the model's vocabulary and the processor vLLM's Gemma 3n processing reads
    (``checkpoints.py``'s, at this size). vLLM 0.33's text-only ``Gemma3nForCausalLM`` never reads the per-layer
    table (only the multimodal class's ``embed_input_ids`` computes the per-layer inputs), so the benchmark
    serves the class a Gemma 3n checkpoint names."""
    from checkpoints import GEMMA3N_SPECIALS, save_gemma3n_frame
    from transformers import Gemma3nTextConfig

    text = Gemma3nTextConfig()
    got = dict(layers=text.num_hidden_layers, hidden=text.hidden_size, vocab=text.vocab_size,
               ple_vocab=text.vocab_size_per_layer_input, ple_dim=text.hidden_size_per_layer_input)
    want = {k: GEMMA3N[k] for k in got}
    if got != want:
        raise RuntimeError(f"this transformers' Gemma3nTextConfig defaults are {got}, not E4B's {want}")
    if len(GEMMA3N_SPECIALS) > PROMPT_ID_MIN:
        raise RuntimeError(f"{len(GEMMA3N_SPECIALS)} special tokens: the prompts' ids from {PROMPT_ID_MIN} on would "
                           "meet them")
    os.makedirs(path, exist_ok=True)
    _, ids = save_gemma3n_frame(path, text)
    return {"path": path, "layer_types": sorted(set(text.layer_types)), "media_token_ids": ids}


def model_config(plan: dict, attention: str = "indexed_attention") -> dict:
    """``Qwen4ExpTextConfig`` keyword arguments for the planned model (``attention``: the attention layers'
    type name, which transformers 5.18 changed from ``qwen_sparse_attention``)."""
    n = plan["layers"]
    kw = dict(REAL, num_experts=plan["experts"], num_hidden_layers=n,
              ple_layer_ids=[plan.get("ple_layer", PLE_LAYER)],
              ngram_vocab_size_base=plan["ngram_vocab_size_base"],
              layer_types=[("linear_attention" if (i + 1) % PERIOD else attention) for i in range(n)],
              max_position_embeddings=4096, eos_token_id=248044, bos_token_id=248044, pad_token_id=248044,
              tie_word_embeddings=False, output_gate_type="silu")  # vLLM's GDN asserts the gate type is named
    return kw


def write_model(path: str, plan: dict) -> dict:
    """``path/config.json`` of the planned model (transformers writes it: its version's field names)."""
    from transformers import Qwen4ExpTextConfig

    attention = next(t for t in Qwen4ExpTextConfig().layer_types if t != "linear_attention")  # this version's name
    cfg = Qwen4ExpTextConfig(**model_config(plan, attention))
    cfg.architectures = ["Qwen4ExpForCausalLM"]
    cfg.dtype = "bfloat16"
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    return {"path": path, "layer_types": sorted(set(cfg.layer_types))}


# ============================================================================================== one engine
def engine_kwargs(a: argparse.Namespace, config: str, model_path: str, shared: bool) -> tuple[dict, bool]:
    """``vllm.LLM``'s arguments for ``config``, and whether the plugin is loaded."""
    plugin, engram, uvaple = CONFIGS[config]
    shapes = a.engine_batches or a.batches
    top = max(shapes)
    qwen = getattr(a, "model", "qwen4exp") == "qwen4exp"
    additional = {"gdn_prefill_backend": "triton"} if qwen else {}
    if uvaple is not None:
        additional["uvaple"] = dict(uvaple, shared=shared, metrics_interval_s=0,
                                    segment=f"bench-{config}-{os.getpid()}")
        if "hot_cache_gb" in uvaple:  # ranked on a profile of the prompts' law (written by main)
            additional["uvaple"]["hot_profile"] = os.path.join(a.work, "hot_profile.npy")
    kw = dict(model=model_path, skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16", seed=0,
              max_model_len=a.prompt + a.decode + 16, max_num_seqs=top,
              max_num_batched_tokens=max(top * a.prompt, a.prompt + a.decode + 16),
              cudagraph_capture_sizes=sorted(set(shapes)), kv_cache_memory_bytes=KV_CACHE_BYTES,
              gpu_memory_utilization=0.92, enable_prefix_caching=False, attention_backend="TRITON_ATTN",
              disable_log_stats=False, jit_monitor_verbose=True, additional_config=additional)
    if engram is not None and qwen:  # Qwen4Exp's n-gram table only
        kw["engram_config"] = engram
    if not qwen:  # Gemma 3n: its processor needs the tokenizer; no image or audio, the multimodal path kept (the
        # runner then embeds through embed_input_ids, which computes the per-layer inputs: engine_check's settings)
        kw.pop("skip_tokenizer_init")
        kw.update(limit_mm_per_prompt={"image": 0, "audio": 0}, enable_mm_embeds=True)
    if a.profile:  # the workers' torch profiler, started and stopped around the profiled call only
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir(a.work, config),
                                 "torch_profiler_with_stack": False, "ignore_frontend": True}
    return kw, plugin


def profile_dir(work: str, config: str) -> str:
    return os.path.join(work, "profile", config)


def child_env(plugin: bool, work: str) -> dict:
    """engine_check's engine environment, the compile caches shared under ``work`` (see the module docstring).
    A profiled engine's is the same: vLLM's worker names each step while its profiler runs, which is what
    ``trace_summary`` cuts at, so the timed runs are a plain engine's."""
    return vllm_env(plugin, logging_config(os.path.join(work, "logging.json")), os.path.join(work, "vllm_cache"),
                    TRITON_CACHE_DIR=os.path.join(work, "triton_cache"))


class GpuUtil:
    """The GPU's utilisation (NVML, every ``period`` s) while a block runs: its mean, or None without NVML."""

    def __init__(self, period: float = 0.02) -> None:
        self.period, self.samples = period, []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML: no utilisation figure
            self.nvml = None

    def __enter__(self):
        import threading

        self.samples, self._stop = [], threading.Event()
        if self.nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.nvml is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples), 1) if self.samples else None


def decode_step_ms(outs, n: int) -> float | None:
    """The decode step from the requests' engine-core timestamps: median of (last - first token) / (n - 1)."""
    steps = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        if not first or not last or len(o.outputs[0].token_ids) != n:
            return None
        steps.append((last - first) / (n - 1) * 1e3)
    return statistics.median(steps)


def run_child(spec_path: str) -> int:
    """One configuration's engine: start it, time every batch, write ``spec['result']`` after each."""
    spec = json.load(open(spec_path))
    res: dict = {"config": spec["config"], "call": spec["call"], "ok": False, "batches": {}}

    def save() -> None:
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(spec["result"] + ".tmp", spec["result"])

    stage = "import"
    try:
        import random

        if spec.get("cpus"):  # before vLLM starts its processes: they inherit the cores
            os.sched_setaffinity(0, spec["cpus"])
            res["cpus"] = spec["cpus"]

        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        stage = "LLM()"
        from uvaple.uva.system import mem_available_bytes

        before = mem_available_bytes() or 0
        t0 = time.monotonic()
        llm = LLM(**spec["kwargs"])
        res["init_s"] = round(time.monotonic() - t0, 1)
        res["host_bytes_taken"] = before - (mem_available_bytes() or 0)
        comp = llm.llm_engine.vllm_config.compilation_config
        res["compilation"] = {"mode": str(getattr(comp, "mode", None)),
                              "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None))}
        save()
        rng = random.Random(1234)
        vocab, n = spec["vocab"], spec["decode"]
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        many = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        util = GpuUtil()
        for b in spec["batches"]:
            stage = f"batch {b}"
            ps = [TokensPrompt(prompt_token_ids=prompt_ids(rng, spec["prompt"], vocab, spec.get("zipf", False)))
                  for _ in range(b)]
            # warm-up of this shape, both calls as they are timed, until a pass compiles nothing (on the H200 one
            # pass left fused-MoE kernels to compile in the first timed repetitions at batch 8)
            def both(ps=ps) -> None:
                llm.generate(ps, one, use_tqdm=False)
                llm.generate(ps, many, use_tqdm=False)

            passes = warm_up(both, lambda: jit_count(spec.get("log")), spec.get("warmup_passes", WARMUP_PASSES))
            entry = {"ttft_s": [], "step_ms": [], "decode_wall_s": [], "gpu_util": [], "warmup_passes": passes}
            print(f"=== uvaple-bench timed start batch {b}", flush=True)
            for _ in range(max(spec["reps"], spec["reps_batch1"]) if b == 1 else spec["reps"]):
                t0 = time.perf_counter()
                llm.generate(ps, one, use_tqdm=False)
                t1 = time.perf_counter()
                with util:
                    outs = llm.generate(ps, many, use_tqdm=False)
                t2 = time.perf_counter()
                step = decode_step_ms(outs, n)
                entry["ttft_s"].append(round(t1 - t0, 5))
                entry["decode_wall_s"].append(round(t2 - t1, 5))
                entry["step_ms"].append(round(step if step is not None else (t2 - t1 - (t1 - t0)) / (n - 1) * 1e3,
                                              5))
                entry["step_from"] = "engine timestamps" if step is not None else "wall clock, T(N) - T(1)"
                entry["gpu_util"].append(util.mean)
            print(f"=== uvaple-bench timed end batch {b}", flush=True)
            res["batches"][str(b)] = entry
            save()
        if spec.get("profile"):
            b = spec["profile"]
            stage = f"profile batch {b}"
            ps = [TokensPrompt(prompt_token_ids=prompt_ids(rng, spec["prompt"], vocab, spec.get("zipf", False)))
                  for _ in range(b)]
            tokens = SamplingParams(temperature=0.0, max_tokens=spec["profile_tokens"], ignore_eos=True,
                                    detokenize=False)
            if str(b) not in res["batches"]:  # a shape not timed above: warm it first
                llm.generate(ps, one, use_tqdm=False)
                llm.generate(ps, tokens, use_tqdm=False)
            llm.start_profile(profile_prefix=spec["config"])
            llm.generate(ps, tokens, use_tqdm=False)
            llm.stop_profile()
            res["profiled"] = {"batch": b, "tokens": spec["profile_tokens"], "prompt": spec["prompt"]}
            save()
        stage = "shutdown"
        llm.llm_engine.engine_core.shutdown()
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - a failed run is a result
        res["stage"], res["error"] = stage, f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-6000:]
    save()
    sys.stdout.flush()
    os._exit(0)


# ============================================================================================== the bench
def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


JIT_MARK = "during inference"  # in every line vLLM's JIT monitor logs for a compile after its own warm-up
WARMUP_PASSES = 4


def jit_count(log_path: str | None) -> int:
    """How many lines of vLLM's JIT monitor the engine's log holds so far (the engine's processes log to it)."""
    if not log_path or not os.path.exists(log_path):
        return 0
    with open(log_path, errors="replace") as f:
        return sum(JIT_MARK in line for line in f)


def warm_up(one_pass, jit_seen, most: int = WARMUP_PASSES) -> int:
    """Run ``one_pass`` (a shape's calls, as they are timed) until a pass adds no line to ``jit_seen()`` (no kernel
    compiled), at most ``most`` times; the passes run. Which kernels a shape compiles is not all fixed by the shape:
    the tokens of a step follow when the requests reach the engine core (``generate`` hands them over while the
    core already steps: a batch's prefill may be split over two steps), and Triton specialises integer arguments on
    their divisibility by 16, so one pass can leave a compile to the timed runs."""
    for n in range(1, most + 1):
        before = jit_seen()
        one_pass()
        if jit_seen() == before:
            return n
    return most


def jit_lines(log_path: str) -> dict[str, list[str]]:
    """vLLM's JIT-monitor lines logged between each batch's timed markers."""
    out: dict[str, list[str]] = {}
    batch = None
    if not os.path.exists(log_path):
        return out
    for line in open(log_path, errors="replace"):
        if "=== uvaple-bench timed start batch" in line:
            batch = line.rsplit(" ", 1)[1].strip()
            out.setdefault(batch, [])
        elif "=== uvaple-bench timed end batch" in line:
            batch = None
        elif batch is not None and JIT_MARK in line:
            out[batch].append(line.strip()[:300])
    return out


START_PHASES = {"load_s": re.compile(r"Model loading took .* and ([0-9.]+) seconds"),
                "init_engine_s": re.compile(r"init engine \(.*\) took ([0-9.]+) s")}


def start_phases(log_path: str) -> dict[str, float]:
    """The engine start's two phases as vLLM logs them: loading the model (weights and host tables: vLLM's dummy
    fill or the checkpoint, the plugin's tables) and initialising the engine (the dummy run, KV cache, warm-up
    and graph capture; Triton compiling into an empty cache makes most of it for the first engine of a machine)."""
    out: dict[str, float] = {}
    if os.path.exists(log_path):
        for line in open(log_path, errors="replace"):
            for key, pattern in START_PHASES.items():
                m = pattern.search(line)
                if m and key not in out:
                    out[key] = round(float(m.group(1)), 1)
    return out


def figures(results: dict[str, dict]) -> dict[str, dict]:
    """Per configuration and batch: tokens/s, step ms, TTFT ms (median, min, max), GPU utilisation, JIT lines,
    and the ratios of the medians to ``hbm`` and ``host``."""
    table: dict[str, dict] = {}
    for name, r in results.items():
        for b, e in (r.get("batches") or {}).items():
            tps = [int(b) * 1e3 / s for s in e["step_ms"]]
            row = {"tokens_per_s": summary(tps), "step_ms": summary(e["step_ms"]),
                   "ttft_ms": summary([t * 1e3 for t in e["ttft_s"]]),
                   "gpu_util_pct": summary([u for u in e["gpu_util"] if u is not None]) if any(
                       u is not None for u in e["gpu_util"]) else None,
                   "jit_lines": len((r.get("jit") or {}).get(b, []))}
            table.setdefault(name, {})[b] = row
    for name, rows in table.items():
        for b, row in rows.items():
            for ref in ("hbm", "host"):
                other = table.get(ref, {}).get(b)
                if other is not None and ref != name:
                    row[f"x_{ref}_tokens_per_s"] = round(row["tokens_per_s"]["median"] /
                                                         other["tokens_per_s"]["median"], 4)
                    row[f"x_{ref}_ttft"] = round(row["ttft_ms"]["median"] / other["ttft_ms"]["median"], 4)
    return table


def markdown(table: dict, results: dict, plan: dict, a: argparse.Namespace) -> str:
    if plan.get("model") == "gemma3n":
        what = (f"Gemma 3n E4B (the multimodal class), {plan['layers']} layers (hidden 2,048), its per-layer table of "
                f"{plan['ple_rows']:,} ids x {plan['ple_row_values']:,} (bf16 "
                f"{plan['table_bytes_about'] / GIB:.1f} GiB), prompts of Zipf-distributed token ids")
    else:
        what = (f"Qwen4Exp, {plan['layers']} layers x {plan['experts']} experts (hidden 2,560), one PLE layer "
                f"(layer {plan.get('ple_layer', PLE_LAYER)}) of 16 heads x {plan['ngram_vocab_size_base']:,} rows "
                f"x 160 (bf16 {plan['table_bytes_about'] / GIB:.1f} GiB)")
    lines = [f"{what}; prompts {a.prompt} tokens, {a.decode} decoded, {a.reps} repetitions "
             f"({max(a.reps, getattr(a, 'reps_batch1', a.reps))} at batch 1): median [min-max]", "",
             "| config | batch | decode tok/s | x hbm | x host | step ms | TTFT ms | TTFT x hbm | GPU util % | JIT |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in [c for c in CONFIGS if c in table]:
        for b in sorted(table[name], key=int):
            r = table[name][b]
            t, s, f = r["tokens_per_s"], r["step_ms"], r["ttft_ms"]
            util = r["gpu_util_pct"]["median"] if r["gpu_util_pct"] else "-"
            lines.append(f"| {name} | {b} | {t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}] | "
                         f"{r.get('x_hbm_tokens_per_s', '-')} | {r.get('x_host_tokens_per_s', '-')} | "
                         f"{s['median']:.3f} | {f['median']:.1f} [{f['min']:.1f}-{f['max']:.1f}] | "
                         f"{r.get('x_hbm_ttft', '-')} | {util} | {r['jit_lines'] or 'none'} |")
    lines += ["", "Engine start: `LLM()` wall time, and vLLM's two phases of it (model loading: weights and host "
              "tables; engine init: dummy run, KV cache, warm-up, graph capture). The engines share one compile "
              "cache, so the first of a machine also compiles the Triton kernels the later ones find.", "",
              "| config | engine start s | model loading s | engine init s | host GiB taken | GPU weights GiB | "
              "segments left at its stop | ok |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        host = r.get("host_bytes_taken")
        ok = "yes" if r.get("ok") else f"no: {str(r.get('error'))[:120]}"
        phases = r.get("start_phases") or {}
        lines.append(f"| {name} | {r.get('init_s', '-')} | {phases.get('load_s', '-')} | "
                     f"{phases.get('init_engine_s', '-')} | {'-' if host is None else round(host / GIB, 1)} | "
                     f"{r.get('weights_gib', '-')} | {len(r.get('segments_left') or [])} | {ok} |")
    return "\n".join(lines) + "\n"


def profile_summary(trace_dir: str, out: str, config: str) -> dict:
    """The newest worker trace in ``trace_dir``, summarised (:mod:`trace_summary`); the trace itself is copied to
    ``out`` when small enough to bring back, with vLLM's own table of the profile (``*.profiler_out.txt``)."""
    import glob
    import shutil

    for table in glob.glob(os.path.join(trace_dir, "*profiler_out*.txt"))[:1]:
        shutil.copy(table, os.path.join(out, f"profile_{config}_table.txt"))
    traces = sorted(glob.glob(os.path.join(trace_dir, "*.pt.trace.json*")), key=os.path.getmtime)
    if not traces:
        return {"error": f"no trace in {trace_dir}"}
    kept = os.path.join(out, f"profile_{config}.json.gz")
    try:
        events = load(traces[-1])
        if save(trim(events), kept) > TRACE_KEEP_BYTES:
            os.remove(kept)
        summary = summarize(events)
    except TraceError as e:
        return {"error": str(e), "trace": traces[-1]}
    summary["trace"] = traces[-1]
    return summary


def profiles_markdown(results: dict) -> str:
    summaries = {name: r["profile"] for name, r in results.items() if r.get("profile") and "steps" in r["profile"]}
    if not summaries:
        return ""
    batch = next(r["profiled"]["batch"] for r in results.values() if r.get("profiled"))
    return f"\nProfiled decode steps at batch {batch} (torch profiler in the engine's worker):\n\n" + \
        trace_markdown(summaries)


def parse_cpus(text: str) -> list[int]:
    """``'0-7,12'`` as sorted core numbers, each one this process may run on; ``''``: none given."""
    cpus: set[int] = set()
    for part in (x.strip() for x in text.split(",") if x.strip()):
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"{part!r} is not a core or a range of cores like 0-7") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r}: a range runs from a core to a later one")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if cpus - allowed:
        raise ValueError(f"cores {sorted(cpus - allowed)} are not among this process's {sorted(allowed)}")
    return sorted(cpus)


def shm_free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def spec_changes(spec_path: str, spec: dict) -> list[str]:
    """The fields of ``spec`` (a configuration's measurement: its engine, shapes and repetitions) that differ from
    the one saved at ``spec_path`` by the call that measured it; every field when none was saved."""
    try:
        with open(spec_path) as f:
            saved = _measured(json.load(f))
    except (OSError, ValueError, AttributeError):
        return sorted(spec)
    now = _measured(json.loads(json.dumps(spec, default=str)))  # as saved: tuples as lists, objects as their text
    return sorted(k for k in now.keys() | saved.keys() if now.get(k) != saved.get(k))


def _measured(spec: dict) -> dict:
    """``spec`` without what names a call rather than what it measures: the plugin's segment (its name holds the
    call's pid), the call's text (made from the engine's arguments) and its log's path."""
    spec = {k: v for k, v in spec.items() if k not in ("call", "log")}
    plugin = ((spec.get("kwargs") or {}).get("additional_config") or {}).get("uvaple")
    if isinstance(plugin, dict) and "segment" in plugin:
        kw = dict(spec["kwargs"])
        kw["additional_config"] = {**kw["additional_config"], "uvaple": {k: v for k, v in plugin.items()
                                                                         if k != "segment"}}
        spec["kwargs"] = kw
    return spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="decode-bench-out", help="decode_bench.json/.md/.log go here")
    p.add_argument("--model", default="qwen4exp", choices=list(MODELS),
                   help="Qwen4Exp at the served widths (default), or Gemma 3n E4B's text model")
    p.add_argument("--work", default=None, help="the model's config, compile caches, results (kept; default "
                   "/tmp/vllm_decode, /tmp/vllm_decode_gemma3n for Gemma 3n)")
    p.add_argument("--configs", default=None, help=f"of {list(CONFIGS)} (default: the model's, "
                   + "; ".join(f"{m}: {','.join(v['default'])}" for m, v in MODELS.items()) + ")")
    p.add_argument("--batches", default="1,8,32,64", help="the batches timed")
    p.add_argument("--engine-batches", default="", help="the batches the engine is built for (CUDA graph sizes, "
                   "max_num_seqs; default: --batches): time batch 1 alone in the engine of the whole table")
    p.add_argument("--profile", type=int, default=0, metavar="BATCH", help="after the timings, profile "
                   "--profile-tokens decode steps at this batch (torch profiler in vLLM's worker) and summarise them")
    p.add_argument("--profile-tokens", type=int, default=48)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--decode", type=int, default=256, help="tokens decoded")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--reps-batch1", type=int, default=15, help="repetitions at batch 1 (its runs are short, and "
                   "noisy: the H200's spread there was +-13%%)")
    p.add_argument("--cpus", default="", help="host cores every engine (each of its processes) runs on, e.g. "
                   "'0-7': a batch-1 step is mostly the engine's host work, and engines left to the scheduler ran "
                   "it up to 1.7 x apart (default: the cores this process may use)")
    p.add_argument("--table-gib", type=float, default=24.0, help="the n-gram table's bf16 size (Qwen4Exp)")
    p.add_argument("--layers", default="fit", help="'fit' or a multiple of 4 (Qwen4Exp)")
    p.add_argument("--experts", type=int, default=512, help="(Qwen4Exp)")
    p.add_argument("--ple-layer", type=int, default=PLE_LAYER, help="the PLE layer, 1-based (Qwen4Exp; default "
                   "1, the first: vLLM's host path starts a later one's gather a layer early, on a side stream)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="start no configuration after this long")
    p.add_argument("--force", action="store_true", help="repeat configurations already measured in --work")
    p.add_argument("--plan", action="store_true", help="print the model, sizes and engine calls; run nothing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return run_child(a.child)
    if a.work is None:
        a.work = "/tmp/vllm_decode" + ("" if a.model == "qwen4exp" else f"_{a.model}")
    if a.configs is None:
        a.configs = ",".join(MODELS[a.model]["default"])
    try:
        a.configs = [c for c in a.configs.split(",") if c]
        a.batches = [int(b) for b in a.batches.split(",") if b]
        a.engine_batches = [int(b) for b in a.engine_batches.split(",") if b]
    except ValueError:
        p.error(f"--batches, --engine-batches: expected comma-separated integers, got {a.batches!r}, "
                f"{a.engine_batches!r}")
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad or not a.configs:
        p.error(f"--configs: {bad or 'none given'}; choose from {list(CONFIGS)}")
    for c in a.configs:
        if c not in MODELS[a.model]["configs"]:
            p.error(f"--configs {c} with --model {a.model}: {NOT_FOR.get((a.model, c), 'not for this model')}; "
                    f"{a.model}'s are {list(MODELS[a.model]['configs'])}")
    if a.model != "qwen4exp":
        given = [f for f, v, d in (("--table-gib", a.table_gib, 24.0), ("--layers", a.layers, "fit"),
                                   ("--experts", a.experts, 512),
                                   ("--ple-layer", a.ple_layer, PLE_LAYER)) if v != d]
        if given:
            p.error(f"{', '.join(given)} with --model {a.model}: they shape Qwen4Exp; {a.model} is E4B's real "
                    "size")
    for name in ("prompt", "decode", "reps", "reps_batch1"):
        if getattr(a, name) < (2 if name == "decode" else 1):
            p.error(f"--{name} must be at least {2 if name == 'decode' else 1}, got {getattr(a, name)}")
    if not a.batches or min(a.batches + a.engine_batches) < 1:
        p.error(f"--batches: positive batch sizes, got {a.batches}")
    shapes = a.engine_batches or a.batches
    if max(a.batches) > max(shapes):
        p.error(f"--engine-batches {shapes}: the engine must hold the largest batch timed ({max(a.batches)})")
    if a.profile < 0 or a.profile > max(shapes) or a.profile_tokens < 8:
        p.error(f"--profile {a.profile}: a batch from 1 to {max(shapes)} (0: no profile), and --profile-tokens at "
                f"least 8 (got {a.profile_tokens})")
    try:
        a.cpus = parse_cpus(a.cpus)
    except ValueError as e:
        p.error(f"--cpus {a.cpus!r}: {e}")
    if not (0 < a.table_gib < 1024) or a.experts < REAL["num_experts_per_tok"]:
        p.error("--table-gib must be in (0, 1024) and --experts at least the 10 experts a token takes")
    try:
        plan = plan_gemma3n() if a.model == "gemma3n" else \
            plan_model(a.table_gib, a.layers if a.layers == "fit" else int(a.layers), a.experts, a.ple_layer)
    except ValueError as e:
        p.error(str(e) if str(e).startswith("--") else f"--layers {a.layers!r}: {e}")
    a.out, a.work = os.path.abspath(a.out), os.path.abspath(a.work)
    if a.plan:
        print(json.dumps({"plan": plan, "config": GEMMA3N if a.model == "gemma3n" else model_config(plan),
                          "engines": {c: engine_kwargs(a, c, os.path.join(a.work, "model"), True)[0]
                                      for c in a.configs}}, indent=1, default=str))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("decode_bench: no CUDA GPU here; this benchmark runs vLLM's engine on a GPU (--plan shows what it "
              "would run)", file=sys.stderr)
        return 2
    if a.model == "qwen4exp" and a.layers == "fit":  # the most layers this GPU holds, not an H200's
        gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        try:
            plan = plan_model(a.table_gib, "fit", a.experts, a.ple_layer, gpu_gib)
        except ValueError as e:
            print(f"decode_bench: {e}; on this GPU ({gpu_gib:.1f} GiB) --layers fit gives "
                  f"{plan_model(a.table_gib, 'fit', a.experts, PLE_LAYER, gpu_gib)['layers']}: give a PLE layer "
                  "within them, or --layers N", file=sys.stderr)
            return 2
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(os.path.join(a.work, "results"), exist_ok=True)
    log = Log(os.path.join(a.out, "decode_bench.log"))
    t_end = time.monotonic() + a.deadline_s
    model_path = os.path.join(a.work, "model")
    info = write_gemma3n(model_path) if a.model == "gemma3n" else write_model(model_path, plan)
    if "uva_hot" in a.configs:
        info["hot_profile"] = write_hot_profile(os.path.join(a.work, "hot_profile.npy"), GEMMA3N["ple_vocab"])
    shared = shm_free_bytes() > plan["table_bytes_about"] * 1.1
    log(f"model: {json.dumps(plan)}; {info}; plugin tables in {'/dev/shm segments' if shared else 'private memory'}"
        f" (/dev/shm has {shm_free_bytes() / GIB:.0f} GiB free)")
    results: dict[str, dict] = {}
    state = {"plan": plan, "args": {k: v for k, v in vars(a).items() if k != "child"}, "notes": []}

    def save() -> None:
        state["results"] = results
        state["figures"] = figures(results)
        for path, text in ((os.path.join(a.out, "decode_bench.json"), json.dumps(state, indent=1, default=str)),
                           (os.path.join(a.out, "decode_bench.md"),
                            markdown(state["figures"], results, plan, a) + profiles_markdown(results))):
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)

    for config in a.configs:
        result_path = os.path.join(a.work, "results", f"{config}.json")
        log_path = os.path.join(a.work, "results", f"{config}.log")
        kw, plugin = engine_kwargs(a, config, model_path, shared)
        call = "vllm.LLM(" + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"
        spec = {"config": config, "kwargs": kw, "call": call, "batches": a.batches, "prompt": a.prompt,
                "decode": a.decode, "reps": a.reps, "reps_batch1": a.reps_batch1,
                "vocab": GEMMA3N["ple_vocab"] if a.model == "gemma3n" else REAL["vocab_size"],
                "zipf": a.model == "gemma3n",
                "profile": a.profile, "profile_tokens": a.profile_tokens, "cpus": a.cpus, "result": result_path,
                "model": plan, "log": log_path, "warmup_passes": WARMUP_PASSES}
        spec_path = os.path.join(a.work, "results", f"{config}.spec.json")
        if os.path.exists(result_path) and not a.force:
            r = json.load(open(result_path))
            changed = spec_changes(spec_path, spec)
            if r.get("ok") and not changed:
                results[config] = r
                log(f"{config}: measured in an earlier call with the same arguments (kept; --force repeats it)")
                continue
            if r.get("ok"):
                log(f"{config}: measured in an earlier call with other {', '.join(changed)}: measured again")
        left = t_end - time.monotonic()
        if left < 150:
            state["notes"].append(f"{config}: not started, {left:.0f} s left; the next call continues")
            log(state["notes"][-1])
            continue
        with open(spec_path, "w") as f:
            json.dump(spec, f, indent=1)
        if os.path.exists(result_path):
            os.remove(result_path)
        log(f"{config}: {call}")
        with open(log_path, "w") as f:
            proc = subprocess.Popen([sys.executable, HERE, "--child", spec_path], stdout=f, stderr=subprocess.STDOUT,
                                    env=child_env(plugin, a.work), start_new_session=True)
            try:
                proc.wait(timeout=max(30.0, left - 10))
            except subprocess.TimeoutExpired:
                log(f"{config}: no result within {left - 10:.0f} s: stopped (what it measured is kept)")
            _kill_group(proc)
        segment = (kw.get("additional_config", {}).get("uvaple") or {}).get("segment")
        stale = [x.get("name", x.get("error")) for x in segments_left(segment)] if plugin and segment else []
        r = json.load(open(result_path)) if os.path.exists(result_path) else {
            "config": config, "call": call, "ok": False, "stage": "timeout", "error": "no result (killed)"}
        r["segments_left"] = stale
        r["jit"] = jit_lines(log_path)
        r["start_phases"] = start_phases(log_path)
        text = open(log_path, errors="replace").read()
        m = re.findall(r"Model loading took ([0-9.]+) GiB", text)
        r["weights_gib"] = float(m[-1]) if m else None
        r["uvaple_lines"] = [ln.strip()[:300] for ln in text.splitlines() if "uvaple" in ln][:12]
        if not r.get("ok"):
            r["log_tail"] = _tail(log_path, 40)
            if "CUDA out of memory" in text:
                r["error"] = (f"out of GPU memory starting the engine ({plan['layers']} layers, "
                              f"{plan['hbm_total_gib_about']} GiB with the table in HBM): give fewer --layers "
                              f"or a smaller --table-gib; vLLM said: {r.get('error')}")
        if r.get("profiled"):
            r["profile"] = profile_summary(profile_dir(a.work, config), a.out, config)
        with open(result_path, "w") as f:
            json.dump(r, f, indent=1)
        results[config] = r
        state_line = "ok" if r.get("ok") else f"FAILED at {r.get('stage')}: {str(r.get('error'))[:300]}"
        log(f"{config}: {state_line}; start {r.get('init_s')} s, weights {r.get('weights_gib')} GiB, batches "
            f"{sorted(r.get('batches', {}), key=int)}")
        save()
    save()
    log("table:\n" + markdown(state["figures"], results, plan, a) + profiles_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
