"""Does Gemma 3n (E2B shape) give the same tokens with its PLE table in host memory, free its HBM, decode as fast?

Gemma 3n end to end on the GPU: an E2B-shaped text model, PLE table in HBM vs in host memory.

What it checks and measures (one run, one process; every figure below comes from this run):

1. Correctness. Greedy ``generate()`` of ``--new-tokens`` tokens from random prompts: the stock HF model
   (table in HBM, ``nn.Embedding``) and the patched model (``HostScaledEmbedding``) with each backend
   (``uva``, ``device``, ``copy``) give identical tokens; prefill logits are compared bit for bit.
   Tokens >= vocab_size_per_layer_input (262,144; the 256 vision/audio ids of the 262,400 vocabulary)
   are suppressed: transformers < 5.24's text model device-asserts on them.
2. Memory. ``torch.cuda.memory_allocated`` before and after the patch (after ``empty_cache``): the
   drop should be the table's size (3.75 GiB for E2B in bf16). Reserved memory is reported too.
3. Speed. Decode-step time at batch 1 / 8 / 64 for the stock model and each backend:

   * eager (one token per sequence with a DynamicCache, CUDA events, median), sequential and with the
     backends interleaved step by step. HF's eager Gemma 3n decode is bound by the host's launch rate,
     so these times say little about the table;
   * one decode step (StaticCache) captured in a CUDA graph and replayed
     (:func:`graph_decode.decode_graph`): the GPU time of the step, launch overhead gone,
     each replay checked against the eager step. This is the comparison that decides "uva within x% of
     device". The copy backend cannot be captured (its lookup runs host code) and is reported as such;
   * the PLE lookup alone at the same batch;
   * as far as the budget allows, ``generate(cache_implementation="static")``, which transformers
     compiles with ``mode="reduce-overhead"`` (CUDA graphs) on CUDA: ms per token and whether CUDA graphs
     were skipped (inductor counter).

   Failures are caught and reported, never fatal.

Usage (H200, ~7 min with two compiled runs)::

    python3 perf/studies/gemma3n_e2e.py --out perf/results/gemma3n_e2e_$(date +%Y%m%d)

``--tiny --device cpu`` runs a toy config on CPU (Triton interpreter) to smoke-test the script.
The model has random weights (HF's own init, fixed seed, the per-layer branch made live:
:func:`live_per_layer_path`), built directly on the GPU in bf16: no checkpoint, nothing downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback

import torch
from graph_decode import cache_kwarg, decode_graph, random_ids

from uvaple.perf.timing import EventTimer as Timer

log = logging.getLogger("gemma3n_e2e")

GiB = float(1 << 30)
# Gemma 3n E2B text config (google/gemma-3n-E2B text_config): 30 layers, 256 per-layer width, vocab 262,400
# of which the first 262,144 ids have per-layer embeddings.
E2B = dict(
    vocab_size=262_400, vocab_size_per_layer_input=262_144, hidden_size=2048, hidden_size_per_layer_input=256,
    intermediate_size=[8192] * 30, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, num_kv_shared_layers=10, laurel_rank=64, altup_num_inputs=4, sliding_window=512,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 6,
    activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20, final_logit_softcapping=30.0,
    max_position_embeddings=32_768, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)
TINY = dict(
    vocab_size=301, vocab_size_per_layer_input=257, hidden_size=64, hidden_size_per_layer_input=16,
    intermediate_size=96, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2, sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.monotonic(), seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mem(device) -> dict:
    if device.type != "cuda":
        return {"allocated": 0, "reserved": 0}
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


def build_model(cfg_kw: dict, dtype, device, seed: int):
    """A Gemma 3n text model with HF's own random init (fixed seed), built on ``device`` in ``dtype``, its
    per-layer path made live (:func:`live_per_layer_path`)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    cfg = Gemma3nTextConfig(**cfg_kw)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # HF's own init, run on the GPU: seconds, not minutes
            model = Gemma3nForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    live_per_layer_path(model)
    return model.eval()


@torch.no_grad()
def live_per_layer_path(model) -> None:
    """Make the PLE rows reach the logits of a randomly initialised Gemma 3n.

    HF's init sets every layer's ``altup.correct_output_scale`` to zeros, and each layer's per-layer
    branch starts from the corrected output times that scale: the branch (gate, product with the
    per-layer input, projection, norm) is then exactly zero and no PLE row changes a logit. A trained
    checkpoint has it nonzero; here it is set to ones, so comparisons of logits and tokens test the PLE.
    """
    for layer in model.model.layers:
        layer.altup.correct_output_scale.fill_(1.0)


@torch.no_grad()
def decode_step_ms(model, batch, *, prompt_len, steps, warm, high, device, seed=0) -> float:
    """Median time of one decode forward (1 new token per sequence, DynamicCache) at ``batch``."""
    from transformers import DynamicCache

    ids = random_ids(batch, prompt_len, high, device, seed)
    toks = random_ids(warm + steps, batch, high, device, seed + 1)
    cache = DynamicCache(config=model.config)
    key = cache_kwarg(model)
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
    timer = Timer(device)
    for i in range(warm + steps):
        step_ids = toks[i].view(batch, 1)
        timer(lambda step_ids=step_ids: model(input_ids=step_ids, use_cache=True, logits_to_keep=1,
                                              **{key: cache}))
    return timer.median(skip=warm)


@torch.no_grad()
def decode_interleaved(model, module, kinds, batches, *, prompt_len, steps, warm, high, device) -> dict:
    """Median decode-step ms per (backend, batch), backends interleaved step by step in rotating order.

    One prebuilt backend per kind is swapped into the patched module between steps; each kind decodes its
    own DynamicCache from the same prompt and tokens. Each step starts from an idle GPU and is timed to
    completion (host launch + device work).
    """
    from transformers import DynamicCache

    from uvaple.integration import make_lookup
    from uvaple.integration.spec import TableSpec

    key = cache_kwarg(model)
    if device.type == "cuda" and device.index is None:
        # The module looks backends up by the ids' device, which always carries an index ("cuda:0"): a key
        # without one would miss, and the module would rebuild a backend (an HBM copy, a copy thread) per step.
        device = torch.device("cuda", torch.cuda.current_device())
    out_dtype = None if module.compute_dtype == module.table_dtype else module.compute_dtype
    spec = TableSpec.of(module.table, scale=module.scale_value, oob=module.oob, out_dtype=out_dtype)
    prebuilt = {k: (make_lookup(k, module.table, device=device, spec=spec), None) for k in kinds}

    def use(kind):
        module._backends = {(device.type, device.index, module.compute_dtype): prebuilt[kind]}
        module._last_device, module._last = device, prebuilt[kind]
        module.backend_kind = kind
        assert module._lookup_for(device) is prebuilt[kind]  # no rebuild behind the timing

    out: dict = {k: {} for k in kinds}
    try:
        for b in batches:
            ids = random_ids(b, prompt_len, high, device, 11)
            toks = random_ids(warm + steps, b, high, device, 12)
            caches = {}
            for k in kinds:
                use(k)
                caches[k] = DynamicCache(config=model.config)
                model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: caches[k]})
            times: dict = {k: [] for k in kinds}
            for i in range(warm + steps):
                order = kinds[i % len(kinds):] + kinds[: i % len(kinds)]
                for k in order:
                    use(k)
                    sync(device)
                    t = time.perf_counter()
                    model(input_ids=toks[i].view(b, 1), use_cache=True, logits_to_keep=1, **{key: caches[k]})
                    sync(device)
                    if i >= warm:
                        times[k].append((time.perf_counter() - t) * 1e3)
            for k in kinds:
                out[k][b] = statistics.median(times[k])
    finally:
        module._backends = {}
        module._last_device, module._last = None, None
        for lookup, _ in prebuilt.values():
            lookup.close()
    return out


@torch.no_grad()
def lookup_ms(module, batch, *, steps, warm, high, device) -> float:
    ids = random_ids(warm + steps, batch, high, device, 7)
    timer = Timer(device)
    for i in range(warm + steps):
        timer(lambda i=i: module(ids[i].view(batch, 1)))
    return timer.median(skip=warm)


@torch.no_grad()
def greedy(model, prompts, new_tokens, suppress, **kw):
    return model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, suppress_tokens=suppress, **kw)


def cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skip" in k))
    except Exception:  # noqa: BLE001 - diagnostics only
        return -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for gemma3n_e2e.json and gemma3n_e2e.log")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy config (smoke test)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prompts", type=int, default=4, help="random prompts checked with generate()")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--backends", default="uva,device,copy")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                    help="also time decode steps with the backends interleaved step by step")
    ap.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                    help="time decode steps captured in CUDA graphs (hf, device, uva; CUDA only)")
    ap.add_argument("--compile-backends", default="device,uva,hf",
                    help="static-cache + torch.compile generate runs, in priority order ('' to skip)")
    ap.add_argument("--compile-tokens", type=int, default=32)
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend for the static-cache runs ('eager' for a CPU smoke test)")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; compile runs stop when it runs out")
    ap.add_argument("--compile-reserve", type=float, default=90.0,
                    help="start a compile run only with this many seconds of budget left (one ~1 min)")
    args = ap.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "gemma3n_e2e.log")
    with logging_to(log, log_path):
        return _run(args, log_path)


@contextlib.contextmanager
def logging_to(logger: logging.Logger, path: str):
    """The run's own handlers on ``logger`` (a file at ``path`` and stdout) while the block runs: the log
    file is written whoever configured logging."""
    handlers = [logging.FileHandler(path, mode="w"), logging.StreamHandler(sys.stdout)]
    for h in handlers:
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(h)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        for h in handlers:
            logger.removeHandler(h)
            h.close()
        logger.propagate = True


def environment(args, device: torch.device, config: str) -> dict:
    """What a run's JSON says it ran on."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "triton": getattr(__import__("triton"), "__version__", "?"), "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "host_cpus": os.cpu_count(), "config": config, "dtype": args.dtype, "args": vars(args)}


def _run(args, log_path: str) -> int:
    budget = Budget(args.budget)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",") if b]
    backends = [b for b in args.backends.split(",") if b]

    import transformers

    from uvaple.integration.models.gemma3n import HostScaledEmbedding, apply_uvaple_to_gemma3n

    cfg_kw = TINY if args.tiny else E2B
    v_ple, vocab = cfg_kw["vocab_size_per_layer_input"], cfg_kw["vocab_size"]
    suppress = list(range(v_ple, vocab))
    res: dict = {
        "env": environment(args, device, "tiny" if args.tiny else "E2B-shaped (random weights)"),
        "correctness": {}, "memory": {}, "decode_ms": {}, "lookup_ms": {}, "decode_graph": {}, "compiled": {},
        "errors": [],
    }

    def record_error(where, e):
        log.error("%s failed: %s", where, e)
        res["errors"].append({"where": where, "error": f"{type(e).__name__}: {e}",
                              "trace": traceback.format_exc(limit=6)})

    # ---------------------------------------------------------------- build
    t = time.monotonic()
    mem_empty = mem(device)
    model = build_model(cfg_kw, dtype, device, args.seed)
    sync(device)
    table_bytes = v_ple * cfg_kw["num_hidden_layers"] * cfg_kw["hidden_size_per_layer_input"] * dtype.itemsize
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built %s params (%.2f GiB) on %s in %.1f s; PLE table %.3f GiB", f"{n_params:,}",
             n_params * dtype.itemsize / GiB, device, time.monotonic() - t, table_bytes / GiB)
    res["model"] = {"params": n_params, "ple_table_bytes": table_bytes, "build_s": time.monotonic() - t}

    prompts = random_ids(args.prompts, args.prompt_len, v_ple, device, args.seed + 1)

    # ---------------------------------------------------------------- stock model
    with torch.no_grad():
        ref_logits = model(prompts).logits
    ref_tokens = greedy(model, prompts, args.new_tokens, suppress)
    new = ref_tokens[:, args.prompt_len:]
    log.info("stock generate: %d tokens x %d prompts, %d distinct tokens", new.shape[1], new.shape[0],
             int(new.unique().numel()))
    res["correctness"]["distinct_generated_tokens"] = int(new.unique().numel())
    for b in batches:
        res["decode_ms"].setdefault("hf", {})[b] = decode_step_ms(
            model, b, prompt_len=args.prompt_len, steps=args.steps, warm=args.warm, high=v_ple, device=device)
    graph_on = args.graph and device.type == "cuda"
    if args.graph and not graph_on:
        res["decode_graph"]["skipped"] = "CUDA graphs need a CUDA device"

    def graph_point(kind):
        for b in batches:
            try:
                r = decode_graph(model, b, prompt_len=args.prompt_len, steps=args.steps, warm=args.warm,
                                 high=v_ple, device=device)
                res["decode_graph"].setdefault(kind, {})[b] = r
                log.info("graph decode %-6s b=%-3d %.3f ms, replay equals eager: %s", kind, b, r["ms"],
                         r["replay_equals_eager"])
            except Exception as e:  # noqa: BLE001 - report and go on
                record_error(f"graph {kind} b={b}", e)
            gc.collect()
            torch.cuda.empty_cache()

    if graph_on:
        graph_point("hf")
    hf_module = model.model.embed_tokens_per_layer
    for b in batches:
        res["lookup_ms"].setdefault("hf", {})[b] = lookup_ms(hf_module, b, steps=args.steps, warm=args.warm,
                                                             high=v_ple, device=device)
    del hf_module

    # ---------------------------------------------------------------- patch
    mem_before = mem(device)
    t = time.monotonic()
    patch = apply_uvaple_to_gemma3n(model, backend="uva")
    patch_s = time.monotonic() - t
    mem_after = mem(device)
    module: HostScaledEmbedding = model.model.embed_tokens_per_layer
    drop = mem_before["allocated"] - mem_after["allocated"]
    res["memory"] = {"empty": mem_empty, "before_patch": mem_before, "after_patch": mem_after,
                     "allocated_drop": drop, "table_bytes": table_bytes,
                     "drop_over_table": drop / table_bytes if table_bytes else None, "patch_s": patch_s}
    log.info("patched in %.1f s: %s", patch_s, module)
    log.info("allocated before %.3f GiB, after %.3f GiB: drop %.3f GiB (table %.3f GiB); reserved %.3f -> %.3f GiB",
             mem_before["allocated"] / GiB, mem_after["allocated"] / GiB, drop / GiB, table_bytes / GiB,
             mem_before["reserved"] / GiB, mem_after["reserved"] / GiB)

    # ---------------------------------------------------------------- backends, eager
    for kind in backends:
        try:
            module.set_backend(kind)
            with torch.no_grad():
                logits = model(prompts).logits
            tokens = greedy(model, prompts, args.new_tokens, suppress)
            same_logits = bool(torch.equal(logits, ref_logits))
            same_tokens = bool(torch.equal(tokens, ref_tokens))
            res["correctness"][kind] = {"prefill_logits_bit_identical": same_logits,
                                        "generate_tokens_identical": same_tokens}
            if kind == "device":
                res["memory"]["device_backend_allocated"] = mem(device)["allocated"]
            log.info("%-6s prefill logits identical: %s, %d greedy tokens identical: %s", kind, same_logits,
                     args.new_tokens, same_tokens)
            for b in batches:
                res["decode_ms"].setdefault(kind, {})[b] = decode_step_ms(
                    model, b, prompt_len=args.prompt_len, steps=args.steps, warm=args.warm, high=v_ple,
                    device=device)
                res["lookup_ms"].setdefault(kind, {})[b] = lookup_ms(
                    module, b, steps=args.steps, warm=args.warm, high=v_ple, device=device)
        except Exception as e:  # noqa: BLE001 - report and go on
            record_error(f"eager {kind}", e)
    module.set_backend("uva")

    # ---------------------------------------------------------------- decode, CUDA graphs
    # The copy backend runs host code (a CPU gather on its worker thread) inside every lookup, which a CUDA
    # graph cannot replay: it is timed eager only.
    if graph_on:
        for kind in [k for k in backends if k != "copy"]:
            module.set_backend(kind)
            graph_point(kind)
        if "copy" in backends:
            res["decode_graph"]["copy"] = "not capturable: each lookup runs a CPU gather on the worker thread"
        module.set_backend("uva")

    # ---------------------------------------------------------------- decode, interleaved
    # Eager decode is host-bound and drifts with the host: time the backends step by step in rotating order
    # (each step from an idle GPU, wall clock to completion), so drift hits them alike.
    if args.interleave:
        try:
            res["decode_interleaved_ms"] = decode_interleaved(
                model, module, backends, batches, prompt_len=args.prompt_len, steps=args.steps, warm=args.warm,
                high=v_ple, device=device)
            for b in batches:
                row = {k: res["decode_interleaved_ms"][k][b] for k in backends}
                log.info("interleaved decode b=%d: %s", b, ", ".join(f"{k} {v:.3f} ms" for k, v in row.items()))
        except Exception as e:  # noqa: BLE001 - report and go on
            record_error("eager interleaved decode", e)
        module.set_backend("uva")

    # ---------------------------------------------------------------- static cache + torch.compile
    compiled_tokens = {}
    plan = [c for c in args.compile_backends.split(",") if c]
    compile_kw = {}
    if args.compile_backend != "inductor" or device.type != "cuda":
        from transformers import CompileConfig

        cc = CompileConfig(backend=args.compile_backend)
        cc._compile_all_devices = True  # transformers' own switch to compile on CPU (testing)
        compile_kw["compile_config"] = cc
    for name in plan:
        if budget.left() < args.compile_reserve:  # one compile of the 30-layer model takes ~1 min
            res["compiled"][name] = {"skipped": f"budget ({budget.left():.0f} s left)"}
            continue
        try:
            torch._dynamo.reset()
            skips0 = cudagraph_skips()
            if name == "hf":
                patch.revert()
            elif name == "uva-hostview":
                module.set_backend("uva", {"view": "host"})
            else:
                module.set_backend(name)
            one = prompts[:1]
            t = time.monotonic()
            first = greedy(model, one, args.compile_tokens, suppress, cache_implementation="static", **compile_kw)
            sync(device)
            compile_s = time.monotonic() - t
            t = time.monotonic()
            second = greedy(model, one, args.compile_tokens, suppress, cache_implementation="static",
                            **compile_kw)
            sync(device)
            ms_tok = (time.monotonic() - t) * 1e3 / args.compile_tokens
            compiled_tokens[name] = second
            entry = {"first_call_s": compile_s, "ms_per_token_b1": ms_tok,
                     "repeatable": bool(torch.equal(first, second)),
                     "same_tokens_as_eager": bool(torch.equal(second, ref_tokens[:1, :second.shape[1]])),
                     "cudagraph_skips": cudagraph_skips() - skips0 if skips0 >= 0 else None}
            res["compiled"][name] = entry
            log.info("compiled %-12s first call %.1f s, %.2f ms/token (b=1), %s", name, compile_s, ms_tok, entry)
        except Exception as e:  # noqa: BLE001
            record_error(f"compiled {name}", e)
            res["compiled"][name] = {"failed": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            if name == "hf" and patch.reverted:
                patch = apply_uvaple_to_gemma3n(model, backend="uva")
                module = model.model.embed_tokens_per_layer

    # Compiled stock vs compiled patched: the meaningful check under compile (inductor may fuse differently
    # from eager; batch 1 vs the batch-4 eager reference may pick other GEMM kernels).
    for name, toks in compiled_tokens.items():
        if name != "hf" and "hf" in compiled_tokens:
            res["compiled"][name]["same_tokens_as_compiled_hf"] = bool(torch.equal(toks, compiled_tokens["hf"]))

    # ---------------------------------------------------------------- summary
    res["elapsed_s"] = budget.seconds - budget.left()
    with open(os.path.join(args.out, "gemma3n_e2e.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    lines = ["", f"Gemma 3n e2e ({res['env']['config']}, {args.dtype}) on {res['env']['device']}, "
                 f"torch {torch.__version__}, transformers {transformers.__version__}", ""]
    m = res["memory"]
    lines.append(f"GPU allocated: before patch {m['before_patch']['allocated'] / GiB:.3f} GiB, after "
                 f"{m['after_patch']['allocated'] / GiB:.3f} GiB, drop {m['allocated_drop'] / GiB:.3f} GiB "
                 f"= {m['drop_over_table'] or 0:.3f} x table ({table_bytes / GiB:.3f} GiB)")
    ok = all(v.get("generate_tokens_identical") and v.get("prefill_logits_bit_identical")
             for k, v in res["correctness"].items() if isinstance(v, dict))
    verdicts = [f"{k}={'OK' if v['generate_tokens_identical'] and v['prefill_logits_bit_identical'] else 'DIFF'}"
                for k, v in res["correctness"].items() if isinstance(v, dict)]
    lines.append(f"correctness (prefill logits bit-identical, {args.new_tokens} greedy tokens identical): "
                 + ", ".join(verdicts))
    lines.append("")
    head = f"{'backend':<8}" + "".join(f"{'decode b=' + str(b):>14}" for b in batches) + \
        "".join(f"{'PLE b=' + str(b):>12}" for b in batches) + f"{'vs hf @b=' + str(batches[-1]):>14}"
    lines.append(head + "   (ms, medians)")
    base = res["decode_ms"].get("hf", {})
    for kind, row in res["decode_ms"].items():
        look = res["lookup_ms"].get(kind, {})
        ratio = row.get(batches[-1], float("nan")) / base.get(batches[-1], float("nan")) if base else float("nan")
        lines.append(f"{kind:<8}" + "".join(f"{row.get(b, float('nan')):>14.3f}" for b in batches)
                     + "".join(f"{look.get(b, float('nan')):>12.4f}" for b in batches) + f"{ratio:>14.3f}")
    inter = res.get("decode_interleaved_ms")
    if inter:
        lines.append("")
        lines.append("decode step, backends interleaved step by step (ms, medians; ratio to device):")
        for kind, row in inter.items():
            dev = inter.get("device", {})
            lines.append(f"  {kind:<8}" + "".join(
                f"  b={b}: {v:8.3f}" + (f" ({v / dev[b]:.3f}x)" if dev.get(b) else "") for b, v in row.items()))
    graph = {k: v for k, v in res["decode_graph"].items() if isinstance(v, dict)}
    if graph:
        lines.append("")
        lines.append("decode step captured in a CUDA graph (StaticCache; ms, medians of replays; ratio to device):")
        dev = graph.get("device", {})
        for kind, row in graph.items():
            lines.append(f"  {kind:<8}" + "".join(
                f"  b={b}: {r['ms']:8.3f}" + (f" ({r['ms'] / dev[b]['ms']:.3f}x)" if b in dev else "")
                + ("" if r["replay_equals_eager"] else " REPLAY!=EAGER") for b, r in row.items()))
    for kind, why in res["decode_graph"].items():
        if isinstance(why, str):
            lines.append(f"  {kind:<8}  {why}")
    if res["compiled"]:
        lines.append("")
        lines.append("static cache + torch.compile (reduce-overhead), batch 1:")
        for name, entry in res["compiled"].items():
            lines.append(f"  {name:<13} {entry}")
    if res["errors"]:
        lines.append("")
        lines.append("errors: " + "; ".join(f"{e['where']}: {e['error'][:160]}" for e in res["errors"]))
    lines.append(f"\nall eager backends correct: {ok}; elapsed {res['elapsed_s']:.0f} s; log {log_path}")
    log.info("\n".join(lines))
    graph_ok = all(r["replay_equals_eager"] for row in graph.values() for r in row.values())
    return 0 if ok and graph_ok and not any(e["where"].startswith(("eager", "graph")) for e in res["errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
