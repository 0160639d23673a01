"""What does one Qwen4Exp n-gram embedding cost eagerly: transformers' own module with its table in HBM, ours?

``python3 perf/studies/ngram_layer.py [--ngram-base 262147] [--reps 7] [--calls 50] [--json OUT] [--smoke]``

One ``Qwen4ExpTextNGramEmbedding`` at the served widths (hidden 2,560 as the PLE width: 16 heads of 160
values, n-grams of 2 and 3 tokens, 8 heads each), bf16, its table ``16 x --ngram-base`` rows (the hash's and
the gather's cost do not depend on the rows; the real table's 20 M rows a head would not fit HBM beside a
copy). Three forwards on the same tokens, no cache (each call's history is an eos context and its tokens):

* ``hf_hbm``: transformers' module with its table moved to the GPU (the ceiling: no host round trip);
* ``ours``: the drop-in (``ngram_embedding_class().from_module``), table in host memory, ``uva``: the hash
  inside the gather, one kernel launch (:mod:`uvaple.kernels.gather_ngram`);
* ``ours_two_launches``: the same module's history, the hash's launch (:mod:`uvaple.kernels.ngram`), then its
  embedding's gather: what the drop-in ran before the fusion;
* the hash alone, both ways: ``ngram_ids`` (the definition in torch, what the drop-in ran before) and
  ``ngram_rows`` (the kernel).

Shapes: decode batch 1, 8 and 64 (one token each), a prefill of 8,192 tokens at batch 1. Each figure: the
wall time of ``--calls`` back-to-back eager calls, synchronised, divided by the calls (the host's time when
the call is host-bound, the GPU's otherwise), repeated ``--reps`` times after a warm-up of every shape;
median [min-max] in microseconds, and ratios of medians in the same run. Every forward's output is compared
with the ceiling's first (bit for bit: the rows are copies).

``--smoke`` runs tiny shapes on the CPU (the kernels interpreted) to check the script, not to time it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SHAPES = {"decode b1": (1, 1), "decode b8": (8, 1), "decode b64": (64, 1), "prefill 8k": (1, 8192)}
SMOKE_SHAPES = {"decode b1": (1, 1), "decode b3": (3, 1), "prefill 9": (1, 9)}


def build(base: int, device: torch.device, smoke: bool):
    """transformers' module (its table on ``device``) and ours (table in host memory), on the same weights."""
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    from uvaple.integration.models.qwen4_exp import ngram_embedding_class

    width = 64 if smoke else 2560
    config = Qwen4ExpTextConfig(hidden_size=width, ngram_vocab_size_base=base, vocab_size=151_936,
                                eos_token_id=151_643)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        hf = Qwen4ExpTextNGramEmbedding(config, width, layer_idx=1, ple_layer_index=0)
    finally:
        torch.set_default_dtype(previous)
    for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        setattr(hf, name, getattr(hf, name).to(device))  # the hash's buffers where the ids are
    ours = ngram_embedding_class().from_module(hf, backend="uva")  # copies the table to host memory
    hf.ngram_embedding.to(device)
    return hf, ours, config


def per_call_us(fn, calls: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) * 1e6 / calls


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "n": len(values)}


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ngram-base", type=int, default=262_147, help="rows per head (default 262,147)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times nothing")
    a = p.parse_args(argv)
    if a.reps < 1 or a.calls < 1 or a.ngram_base < 16:
        p.error(f"--reps {a.reps}, --calls {a.calls}, --ngram-base {a.ngram_base}: at least 1, 1 and 16")
    if not a.smoke and not torch.cuda.is_available():
        print("ngram_layer: needs a CUDA GPU (run it on the GPU machine; --smoke checks the script here)",
              file=sys.stderr)
        return 2
    from uvaple.integration.models.qwen4_exp import ngram_ids
    from uvaple.kernels.ngram import ngram_rows

    device = torch.device("cpu" if a.smoke else "cuda")
    base = 61 if a.smoke else a.ngram_base
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    hf, ours, config = build(base, device, a.smoke)
    print(f"n-gram embedding: {hf.ngram_heads} heads x {hf.ngram_embedding.embedding_dim} values, "
          f"{hf.ngram_embedding.num_embeddings:,} rows, n-grams up to {hf.ngram_size}; {a.reps} x {a.calls} calls "
          f"a figure", flush=True)
    buffers = dict(multipliers=hf.layer_multipliers, sizes=hf.ngram_heads_vocab_sizes, offsets=hf.ngram_heads_offsets)
    eos = hf.eos_token_id
    results: dict[str, dict] = {}
    cases = {}
    for name, (b, s) in shapes.items():
        g = torch.Generator().manual_seed(b * 100_003 + s)
        ids = torch.randint(0, config.vocab_size, (b, s), generator=g)
        ids[torch.rand(ids.shape, generator=g) < 0.02] = eos
        ids = ids.to(device)
        history = torch.cat([ids.new_full((b, hf.context_len), eos), ids], dim=1)
        cases[name] = {
            "hf_hbm": lambda ids=ids: hf(ids, None),
            "ours": lambda ids=ids: ours(ids, None),
            "ours_two_launches": lambda ids=ids: ours.ngram_embedding(ngram_rows(
                torch.cat([ids.new_full((ids.shape[0], ours.context_len), eos), ids], dim=1), eos=eos,
                last=ids.shape[1], **buffers)).flatten(-2),
            "hash_torch": lambda h=history, s=s: ngram_ids(h, eos=eos, heads_per_ngram=hf.heads_per_ngram, last=s,
                                                           **buffers),
            "hash_kernel": lambda h=history, s=s: ngram_rows(h, eos=eos, last=s, **buffers),
        }
        want = cases[name]["hf_hbm"]()
        got, unfused = cases[name]["ours"](), cases[name]["ours_two_launches"]()
        exact = bool(torch.equal(want.view(torch.int16), got.view(torch.int16))
                     and torch.equal(want.view(torch.int16), unfused.view(torch.int16)))
        same_ids = bool(torch.equal(cases[name]["hash_torch"](), cases[name]["hash_kernel"]()))
        results[name] = {"batch": b, "tokens": s, "rows_bit_identical": exact, "ids_identical": same_ids}
        if not (exact and same_ids):
            print(f"{name}: MISMATCH (rows {exact}, ids {same_ids})", flush=True)
    for fns in cases.values():  # a warm-up of every shape and path first, then the timed rounds
        for fn in fns.values():
            per_call_us(fn, 3, device)
    for name, fns in cases.items():
        times = {k: [] for k in fns}
        for _ in range(a.reps):
            for k, fn in fns.items():  # interleaved: a slow spell of the machine falls on every path
                times[k].append(per_call_us(fn, a.calls, device))
        r = results[name]
        for k, v in times.items():
            r[f"{k}_us"] = spread(v)
        r["ours_x_hf_hbm"] = round(r["ours_us"]["median"] / r["hf_hbm_us"]["median"], 3)
        r["ours_x_two_launches"] = round(r["ours_us"]["median"] / r["ours_two_launches_us"]["median"], 3)
        r["hash_kernel_x_torch"] = round(r["hash_kernel_us"]["median"] / r["hash_torch_us"]["median"], 3)
        print(f"{name}: ours {r['ours_us']['median']} us [{r['ours_us']['min']}-{r['ours_us']['max']}], "
              f"transformers HBM {r['hf_hbm_us']['median']} us [{r['hf_hbm_us']['min']}-{r['hf_hbm_us']['max']}]: "
              f"x{r['ours_x_hf_hbm']}; two launches {r['ours_two_launches_us']['median']} us; hash kernel "
              f"{r['hash_kernel_us']['median']} us vs torch "
              f"{r['hash_torch_us']['median']} us; rows exact {r['rows_bit_identical']}", flush=True)
        if a.json:  # after every shape: a late error keeps what ran
            with open(a.json, "w") as f:
                json.dump({"smoke": a.smoke, "device": str(device), "results": results}, f, indent=1)
    ours.close()
    ok = all(r["rows_bit_identical"] and r["ids_identical"] for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
