"""``uvaple bench --workload hotset``: fewer bytes for token-id PLE rows (hot set, de-duplication, fp8 rows).

Gemma 3n E4B-shaped rows (17,920 B: 35 layers x 256 bf16) over its 262,144-row vocabulary, read by token
ids. Two traces of ids: a *profile* (ranks the rows the hot set holds) and a *serve* trace (timed; its
hit rate is the held-out one). From ``--profile-ids`` / ``--serve-ids`` (``.npy`` or whitespace-separated
ids: a tokenised text, e.g. by :func:`tokenize_files`), else two Zipf(1.1) draws with different seeds (a
stand-in for text, said so in the output).

Calls of up to ``DECODE_MAX`` ids are decode batches: one next token of each of ``n`` sequences, so ``n``
positions of the serve trace drawn independently (64 such sets); bigger calls are prefill chunks, ``n``
consecutive tokens (8 windows). Each record's hit rate is over all its sets. Providers, each timed in CUDA
graphs on the same serve ids (sets drawn at random into the captured buffers before every replay), every
lossless one bit-exact against the uncached lookup first:

* ``uncached``: the direct gather from host memory (the baseline every ratio is over);
* ``peer``: vLLM's kernel shape (one program per row, ``perf/peers.py``);
* ``hot``: a hot set of ``--hot-fraction`` of the rows (5%) ranked on the profile trace;
* ``hot_online``: the same slots, ranked on the profile's counts plus the ids served in the serve trace's
  first half (counted on the device, ``HotSet.add_counts`` / ``refresh``); every provider is timed on the
  second half, so both hit rates are held out. It keeps counting while timed (one atomic per id, the cost
  of serving so); ``all_online`` holds its rows without counting;
* ``dedup``: the sorted gather with ``dedup`` (each distinct id of a program read once);
* ``fp8``: the table quantised to ``fp8_row`` (its error report printed), direct;
* ``hot_dedup``: the hot set and the sorted/dedup gather (bf16 rows);
* ``all``: fp8 rows, the hot set and the sorted/dedup gather together; ``all_online`` with the online
  set's rows; ``all_auto`` the same levers with ``order="auto"``, as a server would configure them (a
  decode batch direct, a prefill chunk of ``tuning.dedup_min_ids(hot=True, dequant=True)`` ids or more
  sorted and de-duplicated);
* ``fp8_global``: the same fp8 codes with one global scale instead of each row's own (8,960-byte rows, no
  scale to read per program): the cost of a row scale;
* ``hot_fp8``: fp8 rows and the hot set, direct (two levers, no de-duplication); ``sort``: the device sort
  alone that the sorted paths ran before their gather (``torch.sort`` of the int64 ids into fixed buffers), and
  ``sort_keys`` the one they run now (4-byte keys written on the device, then sorted): together with
  ``all`` these say what de-duplication costs and saves in a call;
* ``fp8_t<tile>_w<warps>``: the direct fp8 gather at other tiles and warps (``FP8_TILES``), bit-exact
  against ``fp8``: the sweep behind the fp8 rows' launch settings; ``*_rows`` (``ROW_TILE_VARIANTS``): fp8 and
  bf16 rows with the tiles of a row launched side by side (``LaunchConfig.row_tiles``).

``--smoke``: a small table on the CPU (interpreted kernels), correctness only (CI).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from uvaple.integration import GatherLookup, HotSet, TableSpec, counts_of_ids, rank_rows
from uvaple.integration.quantize import fp8_row_table
from uvaple.kernels.gather import DirectGather
from uvaple.kernels.tuning import LaunchConfig
from uvaple.uva import HostTable, row_stride_bytes

from . import command
from .peers import vllm_ple_gather
from .timing import graph_replay_us

VOCAB, COLS = 262_144, 35 * 256
NS = (1, 8, 64, 2048, 4096, 8192, 16384)  # 2,048 and 4,096: where de-duplicated prefill starts to pay
DECODE_MAX = 512  # calls of at most this many ids are decode batches (see call_ids)
DECODE_SETS = 64
SMOKE_ROWS, SMOKE_COLS = 4096, 2 * 256  # the --smoke table: 4 MiB of bf16
# fp8 rows' tile sweep beside the shipped (2,048 B of codes, 4 warps: kernels/tuning.py): (bytes of codes
# per program, warps)
FP8_TILES = ((1024, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 8))
# ... and launch orders (tuning.LaunchConfig.row_tiles: the tiles of a row side by side), fp8 and bf16 rows
ROW_TILE_VARIANTS = {"fp8_t2048_w4_rows": ("fp8", LaunchConfig(2048, 4, True)),
                     "fp8_t1024_w4_rows": ("fp8", LaunchConfig(1024, 4, True)),
                     "uncached_rows": ("uncached", LaunchConfig(2048, 4, True))}


# what run() does before the first timed call, each a step of its progress bar
SETUP_STEPS = ("filling the table", "quantising it to fp8_row", "ranking the profile's rows",
               "building the lookups", "counting the served text's first half")


def zipf_ids(n: int, vocab: int, seed: int, s: float = 1.1) -> np.ndarray:
    """``n`` ids drawn by rank from Zipf(``s``) over ``vocab``, the ranks shuffled onto ids by a fixed
    permutation (so frequent ids are spread over the table, as a tokenizer's are)."""
    g = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** s
    ranks = g.choice(vocab, size=n, p=p / p.sum())
    perm = np.random.default_rng(12345).permutation(vocab)
    return perm[ranks].astype(np.int64)


def tokenize_files(paths: list[str]) -> np.ndarray:
    """Token ids of text files with the RWKV "world" tokenizer (``pip install rwkv``: its 65,536-token
    vocabulary ships in the package)."""
    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    vocab = os.path.join(os.path.dirname(rwkv.__file__), "rwkv_vocab_v20230424.txt")
    tok = TRIE_TOKENIZER(vocab)
    ids: list[int] = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            ids += tok.encode(f.read())
    return np.asarray(ids, dtype=np.int64)


def _load_ids(path: str) -> np.ndarray:
    if path.endswith(".npy"):
        return np.load(path).astype(np.int64).reshape(-1)
    with open(path) as f:
        return np.array(f.read().split(), dtype=np.int64)


def launched_with(lk: GatherLookup, out: torch.Tensor, cfg: LaunchConfig):
    """``ids -> rows`` of the direct lookup ``lk`` launched with ``cfg`` instead of the shipped heuristic's
    settings (the tile in elements per program: bytes of codes for fp8 rows): the fp8 rows' tile sweep
    (``FP8_TILES``) and the launch-order variants (``ROW_TILE_VARIANTS``). The launcher is the lookup's
    direct one (its table view, counters and policy) made once with ``cfg``; ``ids`` contiguous."""
    spec = lk.spec
    launcher = DirectGather(lk._arg, lk.device, spec.output_dtype, counters=lk._counters, dq_scale=lk._dq_scale,
                            bits=spec.scale_arg, has_scale=spec.has_scale, id_base=spec.id_offset,
                            row_lo=lk._row_lo, oob_mode=spec.oob_mode, dequant=spec.dequant, config=cfg)

    def gather(ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        o = out[:n]
        launcher(ids, o, 0, n)
        return o
    return gather


def call_ids(serve: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """The id sets of ``n``-id calls drawn from the serve trace, ``[sets, n]``, one set per timed call in
    rotation. A decode batch (``n <= DECODE_MAX``) holds one next token of each of ``n`` sequences: ``n``
    positions of the trace drawn independently, 64 sets. A prefill chunk holds ``n`` consecutive tokens of
    one text: 8 windows at random offsets (a trace shorter than ``n``: draws from it)."""
    g = torch.Generator().manual_seed(seed)
    if n <= DECODE_MAX or len(serve) < n:
        return serve[torch.randint(0, len(serve), (DECODE_SETS if n <= DECODE_MAX else 8, n), generator=g)]
    starts = torch.randint(0, len(serve) - n + 1, (8,), generator=g)
    return torch.stack([serve[s: s + n] for s in starts.tolist()])


def normal_table(rows: int, cols: int, seed: int) -> HostTable:
    """A bf16 host table of N(0, 1) values times a per-layer magnitude (finite: it is quantised too),
    written 64 MiB at a time."""
    t = HostTable.empty(rows, cols, torch.bfloat16, register="auto")
    g = torch.Generator().manual_seed(seed)
    layer_scale = torch.logspace(-2, 0, -(-cols // 256)).repeat_interleave(256)[:cols]
    step = max(1, (64 << 20) // (cols * 2))
    for r0 in command.bar(range(0, rows, step), desc="filling the table", unit="block"):
        n = min(step, rows - r0)
        t.write_rows((torch.randn(n, cols, generator=g) * layer_scale).to(torch.bfloat16), r0)
    return t


def _mask(rows: int, held: torch.Tensor) -> torch.Tensor:
    """A bool per table row: whether ``held`` names it."""
    m = torch.zeros(rows, dtype=torch.bool)
    m[held] = True
    return m


def _exact_into(buf: torch.Tensor, ids: torch.Tensor, fn, want: torch.Tensor) -> bool:
    """Whether ``fn(ids, buf[:n])`` gives ``want``'s bits, ``buf[:n]`` poisoned first (a launch that writes
    nothing fails)."""
    o = buf[: ids.numel()]
    o.view(torch.int16).fill_(0x7FA5)
    return _exact(fn(ids, o), want)


def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def run(rows: int, cols: int, profile: np.ndarray, serve: np.ndarray, hot_fraction: float, ns, device,
        replays: int, smoke: bool, res: dict | None = None) -> dict:
    """Every provider at every ``n`` of ``ns`` (module docstring); the records go into ``res`` (a new dict by
    default) as they are made, so a caller keeps what a failed run measured."""
    setup = command.bar(total=len(SETUP_STEPS), desc="setting up", unit="step")
    setup.set_postfix_str(SETUP_STEPS[0], refresh=False)

    def done(step: int) -> None:
        setup.update(1)
        if step + 1 < len(SETUP_STEPS):
            setup.set_postfix_str(SETUP_STEPS[step + 1])

    table = normal_table(rows, cols, seed=3)
    done(0)
    fp8_table, err = fp8_row_table(table.tensor, out_dtype=torch.bfloat16)
    done(1)
    res = {} if res is None else res
    res.update({"rows": rows, "row_bytes": cols * 2, "fp8_row_bytes": cols + 4, "hot_fraction": hot_fraction,
                "fp8_error": err.summary(), "results": []})
    k = HotSet.capacity_for(table, fraction=hot_fraction)
    profile_counts = counts_of_ids(profile, rows)
    ranked = rank_rows(profile_counts, k)
    done(2)
    serve_t = torch.as_tensor(serve % rows)
    # the online hot set learns from the served text's first half; every provider is timed on the second
    half = len(serve_t) // 2
    warm_t, serve_t = serve_t[:half][: 4096 if smoke else half], serve_t[half:]
    held = _mask(rows, ranked)
    res["hot_rows"] = int(ranked.numel())
    res["held_out_hit_rate"] = float(held[serve_t].float().mean())
    max_n = max(ns)
    spec = TableSpec.of(table)
    fspec = TableSpec.of(fp8_table, encoding="fp8_row", out_dtype=torch.bfloat16)
    # the same codes without their row scales, one global scale (fp8_global): what a row's own scale costs
    g_table = HostTable.from_tensor(fp8_table.tensor[:, :cols].contiguous())
    g_scale = torch.tensor([0.0123], device=device)
    hot = HotSet(table, k, device, rows=ranked.to(device))
    fhot = HotSet(fp8_table, k, device, rows=ranked.to(device))
    lookups = {
        "uncached": GatherLookup(table, spec, device, order="direct"),
        "hot": GatherLookup(table, spec, device, hot=hot, order="direct"),
        "dedup": GatherLookup(table, spec, device, order="sorted", dedup=True, max_rows=max_n),
        "fp8": GatherLookup(fp8_table, fspec, device, order="direct"),
        "fp8_global": GatherLookup(g_table, TableSpec.of(g_table, encoding="fp8_global", out_dtype=torch.bfloat16),
                                   device, dequant_scale=g_scale, order="direct"),
        "all": GatherLookup(fp8_table, fspec, device, hot=fhot, order="sorted", dedup=True, max_rows=max_n),
        "hot_dedup": GatherLookup(table, spec, device, hot=hot, order="sorted", dedup=True, max_rows=max_n),
        "all_auto": GatherLookup(fp8_table, fspec, device, hot=fhot, order="auto", dedup=True, max_rows=max_n),
        "hot_fp8": GatherLookup(fp8_table, fspec, device, hot=fhot, order="direct"),
    }
    online = HotSet(table, k, device, rows=ranked.to(device), count_ids=True)
    online.add_counts(profile_counts)
    lookups["hot_online"] = GatherLookup(table, spec, device, hot=online, order="direct")
    done(3)
    scratch = torch.empty(min(8192, max(1, len(warm_t))), cols, dtype=torch.bfloat16, device=device)
    for a in command.bar(range(0, len(warm_t), scratch.shape[0]), desc="counting served ids", unit="call"):
        part = warm_t[a: a + scratch.shape[0]].to(device)
        lookups["hot_online"].lookup(part, scratch[: part.numel()])
    online.refresh(decay=0)  # profile + the first half's served ids, ranked on the device
    done(4)
    setup.close()
    del scratch
    held_online = _mask(rows, online.held[: online.size].cpu())
    res["online_rows"] = online.size
    res["online_warm_ids"] = len(warm_t)
    res["online_held_out_hit_rate"] = float(held_online[serve_t].float().mean())
    fhot_online = HotSet(fp8_table, k, device, rows=online.held[: online.size].clone())
    lookups["all_online"] = GatherLookup(fp8_table, fspec, device, hot=fhot_online, order="sorted", dedup=True,
                                         max_rows=max_n)
    view = table.cuda_view() if device.type == "cuda" else table.tensor
    out = torch.empty(max_n, cols, dtype=torch.bfloat16, device=device)
    raw = torch.empty(max_n, cols, dtype=torch.bfloat16, device=device)
    try:
        # the direct gather at other launch settings: launchers made once, over the same out
        tiles = {f"fp8_t{t}_w{w}": launched_with(lookups["fp8"], out, LaunchConfig(t, w)) for t, w in FP8_TILES}
        tiles.update({name: launched_with(lookups[base], out, cfg) for name, (base, cfg) in
                      ROW_TILE_VARIANTS.items()})
        for n in command.bar(ns, desc="ids per call", unit="n"):
            sets = call_ids(serve_t, n, seed=n).to(device)
            ids = sets[0]
            want = lookups["uncached"].lookup(ids, torch.empty(n, cols, dtype=torch.bfloat16, device=device)).clone()
            rec = {"n": n, "kind": "decode" if n <= DECODE_MAX else "prefill", "sets": int(sets.shape[0]),
                   "distinct": float(np.mean([torch.unique(x).numel() for x in sets])),
                   "hit_rate": float(held[sets.cpu()].float().mean()),
                   "online_hit_rate": float(held_online[sets.cpu()].float().mean())}
            exact = {name: _exact_into(out, ids, lookups[name].lookup, want)
                     for name in ("hot", "hot_online", "dedup", "hot_dedup")}
            exact["peer"] = _exact_into(raw, ids, lambda i, o: (vllm_ple_gather(view, i, o), o)[1], want)
            f_want = lookups["fp8"].lookup(ids, torch.empty(n, cols, dtype=torch.bfloat16, device=device)).clone()
            for name in ("all", "all_online", "all_auto", "hot_fp8"):
                exact[name + "_vs_fp8"] = _exact_into(out, ids, lookups[name].lookup, f_want)
            for name, fn in tiles.items():
                ref = want if ROW_TILE_VARIANTS.get(name, ("fp8",))[0] == "uncached" else f_want
                exact[name + ("_vs_fp8" if ref is f_want else "")] = _exact_into(out, ids, lambda i, o, fn=fn: fn(i),
                                                                                  ref)
            g_rows = g_table.tensor[ids.cpu()].to(device)  # vLLM's formula on the codes
            exact["fp8_global_vs_formula"] = _exact_into(out, ids, lookups["fp8_global"].lookup, g_rows.to(
                torch.bfloat16) * g_scale.to(torch.bfloat16))
            rec["bit_exact"] = exact
            if device.type == "cuda" and not smoke:
                calls = max(2, min(16, (512 << 20) // (n * cols * 2 * 3)))
                ids_buf = sets[torch.arange(calls, device=device) % sets.shape[0]].clone()

                def refresh(buf, sets=sets):
                    buf.copy_(sets[torch.randint(0, sets.shape[0], (buf.shape[0],), device=device)])

                us = {name: graph_replay_us(lambda i, lk=lk: lk.lookup(i, out[: i.numel()]), ids_buf, refresh,
                                            replays)["median"] for name, lk in lookups.items()}
                us.update({name: graph_replay_us(fn, ids_buf, refresh, replays)["median"]
                           for name, fn in tiles.items()})
                keys, order = torch.empty(max_n, dtype=ids_buf.dtype, device=device), torch.empty(
                    max_n, dtype=torch.int64, device=device)
                us["sort"] = graph_replay_us(
                    lambda i, k=keys, o=order: torch.sort(i, stable=False, out=(k[: i.numel()], o[: i.numel()])),
                    ids_buf, refresh, replays)["median"]
                k32 = torch.empty(2 * max_n, dtype=torch.int32, device=device)
                us["sort_keys"] = graph_replay_us(  # as the sorted paths sort now: 4-byte keys made on the device
                    lambda i, k=k32, o=order: torch.sort(k[: i.numel()].copy_(i), stable=False,
                                                         out=(k[max_n: max_n + i.numel()], o[: i.numel()])),
                    ids_buf, refresh, replays)["median"]
                us["peer"] = graph_replay_us(lambda i: vllm_ple_gather(view, i, raw[: i.numel()]), ids_buf, refresh,
                                             replays)["median"]
                rec["us"] = us
                rec["over_uncached"] = {k2: us["uncached"] / v for k2, v in us.items()}
                rec["all_over_peer"] = us["peer"] / us["all"]
                rec["all_online_over_peer"] = us["peer"] / us["all_online"]
                rec["all_auto_over_peer"] = us["peer"] / us["all_auto"]
                rec["all_auto_sorted"] = lookups["all_auto"].uses_sorted(n)
            command.say(point_line(rec))
            res["results"].append(rec)
    finally:
        for lk in lookups.values():
            lk.close()
        table.close()
        fp8_table.close()
        g_table.close()
    return res


def point_line(rec: dict) -> str:
    """One point as a person reads it (the whole record is in hotset.json): ids, hit rates, what differed, and on
    a GPU the graph-replay microseconds of each lookup and the peer's time over the levers together."""
    differ = [name for name, ok in rec["bit_exact"].items() if not ok]
    line = (f"n={rec['n']:,} ({rec['kind']}, {rec['distinct']:.0f} distinct): hot set hit rate {rec['hit_rate']:.3f}, "
            f"online {rec['online_hit_rate']:.3f}; "
            + (f"DIFFERED: {', '.join(differ)}" if differ else f"all {len(rec['bit_exact'])} checks exact"))
    us = rec.get("us")
    if us:
        names = [k for k in ("uncached", "hot", "dedup", "hot_dedup", "fp8", "all", "all_online", "all_auto", "peer")
                 if k in us]
        line += "; us " + ", ".join(f"{k} {us[k]:.1f}" for k in names) + f"; peer / all {rec['all_over_peer']:.2f}"
    return line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="uvaple bench --workload hotset",
        description="Fewer bytes for token-id PLE rows: a hot set, de-duplication and fp8 rows, alone and together, "
                    "against the uncached lookup and vLLM's kernel shape (Gemma 3n E4B rows), each checked bit for "
                    "bit, then timed in CUDA graphs. Needs a CUDA GPU; --smoke runs it small on the CPU.",
        epilog=command.EXIT_STATUSES.replace("every output agreed", "every lossless provider bit-exact")
        + " Progress goes to stderr, results to stdout and --out.")
    p.add_argument("--profile-ids", help="ids ranking the hot set (.npy or a text of whitespace-separated ids); "
                                         "with --serve-ids (default: two Zipf(1.1) draws, not text)")
    p.add_argument("--serve-ids", help="ids served and timed (a different text); with --profile-ids")
    p.add_argument("--hot-fraction", type=float, default=0.05, help="share of the rows the hot set holds (default "
                                                                    "0.05)")
    p.add_argument("--rows", type=command.positive_ints, default=list(NS),
                   help=f"ids per call, comma-separated (default {','.join(map(str, NS))}; --smoke keeps those up "
                        f"to {DECODE_MAX}, else 64)")
    p.add_argument("--replays", type=command.number(int, meaning="a count"), default=20,
                   help="CUDA-graph replays per timed point (default 20)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a small run on the CPU on any machine: a {SMOKE_ROWS:,}-row table of {SMOKE_COLS} bf16 "
                        "columns, interpreted kernels, correctness only, no timing (well under a minute)")
    p.add_argument("--out", help="directory for hotset.json, made and checked writable before any work (default "
                                 "./uvaple-results/<UTC time>_hotset_<gpu or cpu>/)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p.parse_args(argv)


def check_runnable(a: argparse.Namespace) -> None:
    """Refuse (:class:`command.Refused`) what this machine cannot run, before anything is built."""
    if bool(a.profile_ids) != bool(a.serve_ids):
        raise command.Refused("--profile-ids and --serve-ids go together (the hot set is ranked on one text and "
                              "timed on the other): give both, or neither for two Zipf draws")
    for flag, path in (("--profile-ids", a.profile_ids), ("--serve-ids", a.serve_ids)):
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise command.Refused(f"{flag} {path}: no readable file there (a .npy or a text of token ids)")
    if not 0 < a.hot_fraction < 1:
        raise command.Refused(f"--hot-fraction must lie between 0 and 1, got {a.hot_fraction}")
    if not a.smoke:
        command.needs_cuda("the hotset workload (it times CUDA graphs)",
                           "--smoke runs it small on the CPU (correctness only, well under a minute)")
    rows, cols = (SMOKE_ROWS, SMOKE_COLS) if a.smoke else (VOCAB, COLS)
    # the bf16 table, its fp8_row copy and the same codes with one global scale
    need = rows * cols * 2 + rows * row_stride_bytes(cols + 4) + rows * row_stride_bytes(cols)
    command.check_fits(need, f"the hotset tables ({rows:,} rows of {cols * 2:,} B, their fp8 copies)",
                       "--smoke runs it small")


def main(argv: list[str] | None = None) -> int:
    prog = "uvaple bench --workload hotset"
    a = parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    try:
        check_runnable(a)
        out = command.workload_out("hotset", a.out, cuda)
    except command.Refused as e:
        return command.refuse(prog, e)
    rows, cols = (SMOKE_ROWS, SMOKE_COLS) if a.smoke else (VOCAB, COLS)
    with command.progress(not a.quiet):
        if a.profile_ids and a.serve_ids:
            loading = command.bar([a.profile_ids, a.serve_ids], desc="loading the traces", unit="file")
            profile, serve = (_load_ids(path) for path in loading)
            source = "files"
        else:
            profile, serve = zipf_ids(200_000, rows, seed=1), zipf_ids(200_000, rows, seed=2)
            source = "zipf(1.1) draws, not text: pass --profile-ids/--serve-ids for real text"
        command.say(f"traces: {source}")
        ns = ([n for n in a.rows if n <= DECODE_MAX] or [64]) if a.smoke else a.rows
        device = torch.device("cuda") if cuda else torch.device("cpu")
        res = {"traces": source, "smoke": a.smoke}
        with command.kept_on_failure(out, "hotset.json", res):
            run(rows, cols, profile, serve, a.hot_fraction, ns, device, a.replays, a.smoke, res)
    command.say(f"online hot set {res['online_rows']} rows (profile + {res['online_warm_ids']} served ids); held-out "
                f"hit rate {res['online_held_out_hit_rate']:.3f}")
    command.say(f"hot set {res['hot_rows']} rows ({a.hot_fraction:.0%}); held-out hit rate "
                f"{res['held_out_hit_rate']:.3f}; fp8 error {res['fp8_error']}")
    path = command.write_json(out, "hotset.json", res)
    ok = all(all(r["bit_exact"].values()) for r in res["results"])
    if not ok:
        print("NOT BIT-EXACT: a lossless provider's rows differed (see bit_exact in the results)", file=sys.stderr)
    command.wrote(out, [path])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
