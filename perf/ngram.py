"""``uvaple bench --workload ngram``: random small rows over a big table, the n-gram PLE shape.

160-byte fp8 rows (one n-gram head's row of vLLM's Qwen4Exp PLE table) over a ``--table-gib`` table
(24 GiB by default), dequantised to bf16 with one global scale (vLLM's formula), ``n`` ids per call.
Two id streams: ``random`` (uniform over the table) and ``ngram`` (as the model draws them: for every
token, 16 heads hash the preceding 2-4 tokens into their own slice of the table; tokens are Zipf-
distributed over a 151,936-token vocabulary, so common n-grams repeat).

Providers, all in one run, each output compared bit for bit with a CPU reference before it is timed:

* ``ours-auto``: :class:`~uvaple.integration.GatherLookup` as the plugin builds it (``order="auto"``:
  the sorted gather where the committed sweep says so);
* ``ours-direct`` / ``ours-sorted``: the two paths forced;
* ``vllm-peer``: :func:`~uvaple.perf.peers.vllm_ple_gather` (one program per row, vLLM's shape) then
  vLLM's dequantisation as a separate op;
* ``cpu-gather``: the ids on the host (the scheduler has them), ``torch.index_select`` on every core into
  pinned staging, one host-to-device copy, the dequantisation on the GPU; timed eagerly (it cannot be
  captured), with the CPU seconds it burned per call;
* ``cpu-gather-chunked``: the split's CPU gather alone (``integration.placements.host_gather.gather_up``), the
  copy up in the split's chunks (``placements.split.split_chunk_rows``), each beside the gather of the next; the
  better of the two CPU providers is the one every ratio compares with. The split sweep also times it by
  chunk with torch's ``index_select`` and with the copy backend's numba word gather;
* ``split``: :meth:`~uvaple.integration.SplitLookup.lookup_split`: host ids, the GPU gathers its share
  (``placements.split.SPLIT_GPU_SHARE``) while the calling thread gathers the rest into pinned staging, copied
  up chunk by chunk, the same kernel's policy; timed eagerly, with its CPU seconds;
* ``memcpy``: a pinned host-to-device copy of the same row bytes (the wire);
* ``sequential``: ``ours-direct`` over consecutive ids (the ceiling of the random-row path).

GPU providers are timed in CUDA graphs (fresh ids written before each replay, outside the timed
region); medians. Every timed call reads ids of its own: the id sets rotate, and enough of them that the
rows read between two uses of one set exceed the host's last-level cache and the GPU's L2
(``SET_ROTATE_BYTES``); the host-id providers run in blocks of consecutive calls that take turns. ``--sweep``
also times the direct and the sorted gather on raw bytes by row size (``SWEEP_ROW_BYTES``: 32 B - 2 KiB, 320 B
among them, and 17,920 B), table span and ``n``: the data behind :func:`uvaple.kernels.tuning.use_sorted`.
``--smoke`` runs tiny tables on the CPU (interpreted kernels, correctness only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from uvaple.integration import GatherLookup, SplitLookup, TableSpec
from uvaple.integration.placements import split as split_plan
from uvaple.integration.placements.host_gather import gather_up
from uvaple.kernels import tuning
from uvaple.uva import HostTable, system

from . import command
from .peers import memcpy_ceiling, vllm_ple_gather
from .timing import graph_replay_us
from .vllm_shapes import random_table, reference_rows

ROW_BYTES = 160
HEADS = 16
VOCAB = 151_936
SCALE = 0.0173
N_DEFAULT = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
SWEEP_ROW_BYTES = (32, 160, 320, 512, 2048, 17920)  # 320: an n-gram head's bf16 row, as vLLM serves a bf16 table
SWEEP_SPANS_GIB = (0.25, 1.0, 4.0, None)  # None: the whole table
SWEEP_N = (1024, 4096, 16384, 65536, 262144)
SWEEP_MAX_CALL_BYTES = 1 << 30  # a sweep point moves at most this much per call
GIB = 1 << 30
# Every timed call reads rows of ids no call read in the last SET_ROTATE_BYTES of rows (more than the
# host's 300 MB last-level cache and the GPU's 50 MB L2): the rows come from DRAM, as a prefill's do.
SET_ROTATE_BYTES = 1 << 30
TABLE_GIB = 24.0  # the default table: the size the field reports its n-gram tables at
SMOKE_ROWS = 20_000  # the --smoke table: 3.2 MB
SMOKE_MAX_N = 1024  # --smoke's largest call (interpreted: 256 and 1,024 ids of both patterns, ~40 s of CPU on 2 cores)
SWEEP_FLAGS = ("sweep", "split_sweep", "shape_sweep", "sort_sweep")
HEURISTIC_NAMES = ("SORT_MIN_IDS", "SORT_MIN_IDS_PER_GIB", "SORT_SPARSE_MAX_ROW_BYTES", "SORT_MIN_IDS_SMALL_SPAN",
                   "SORT_MAX_ROW_BYTES", "SORT_MIN_SPAN_BYTES")


def make_table(table_gib: float, smoke: bool) -> HostTable:
    rows = SMOKE_ROWS if smoke else int(table_gib * GIB) // ROW_BYTES
    return random_table(rows, ROW_BYTES, torch.float8_e4m3fn, seed=7)


def ngram_ids(n: int, rows: int, seed: int) -> torch.Tensor:
    """``n`` ids (``n // 16`` tokens x 16 heads) drawn as the n-gram model draws them (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    tokens_n = max(1, -(-n // HEADS))
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float64)
    tok = torch.multinomial(ranks.pow(-1.1), tokens_n + 4, replacement=True, generator=g)
    per_head = rows // HEADS
    out = torch.empty(tokens_n, HEADS, dtype=torch.int64)
    for h in range(HEADS):
        order = 2 + h % 3
        acc = torch.full((tokens_n,), 1 + h, dtype=torch.int64)
        for j in range(order):
            acc = (acc * 1_000_003 + tok[4 - j: 4 - j + tokens_n]) % 2_147_483_647
        out[:, h] = h * per_head + acc % per_head
    return out.reshape(-1)[:n].contiguous()


class Run:
    """One table, its lookups and buffers for a largest call of ``max_n`` ids."""

    def __init__(self, table: HostTable, max_n: int, device: torch.device) -> None:
        self.table, self.device, self.cuda = table, device, device.type == "cuda"
        self.scale = torch.tensor([SCALE], dtype=torch.float32, device=device)
        spec = TableSpec.of(table, encoding="fp8_global", out_dtype=torch.bfloat16)
        self.lookups = {o: GatherLookup(table, spec, device, dequant_scale=self.scale, count=False, max_rows=max_n,
                                        order=o) for o in ("auto", "direct", "sorted")}
        if self.cuda:  # the split path needs pinned staging and a GPU
            self.lookups["split"] = SplitLookup(table, spec, device, dequant_scale=self.scale, count=False,
                                                max_rows=max_n)
        self.view = table.cuda_view() if self.cuda else table.tensor
        self.out = torch.empty(max_n, ROW_BYTES, dtype=torch.bfloat16, device=device)
        self.raw = torch.empty(max_n, ROW_BYTES, dtype=table.dtype, device=device)
        self.staging = torch.empty(max_n, ROW_BYTES, dtype=torch.uint8, pin_memory=self.cuda)
        self.dev_bytes = torch.empty(max_n * ROW_BYTES, dtype=torch.uint8, device=device)
        self.host_bytes = torch.empty(max_n * ROW_BYTES, dtype=torch.uint8, pin_memory=self.cuda)
        if self.cuda:
            self.copy_stream, self.uploaded = torch.cuda.Stream(device), torch.cuda.Event()

    def ours(self, order: str):
        def call(ids):
            self.lookups[order].lookup(ids, self.out[: ids.numel()])
        return call

    def peer(self, ids):
        n = ids.numel()
        vllm_ple_gather(self.view, ids, self.raw[:n])
        torch.mul(self.raw[:n].to(torch.bfloat16), self.scale.to(torch.bfloat16), out=self.out[:n])

    def cpu_gather(self, ids_cpu: torch.Tensor) -> None:
        n = ids_cpu.numel()
        stage = self.staging[:n]
        torch.index_select(self.table.tensor.view(torch.uint8), 0, ids_cpu, out=stage)
        raw = self.raw[:n].view(torch.uint8)
        raw.copy_(stage, non_blocking=True)
        torch.mul(self.raw[:n].to(torch.bfloat16), self.scale.to(torch.bfloat16), out=self.out[:n])

    def cpu_gather_chunked(self, ids_cpu: torch.Tensor, chunk_rows: int | None = None,
                           path: str = split_plan.SPLIT_CPU_PATH) -> None:
        """As :meth:`cpu_gather`, with the split's CPU gather (``path``: torch, or the numba word gather) and
        the copy up chunk by chunk (the split's chunks for ``n`` by default) beside the gather of the next."""
        n = ids_cpu.numel()
        chunk_rows = chunk_rows or split_plan.split_chunk_rows(n)
        gather_up(self.table.tensor.view(torch.uint8), ids_cpu.to(torch.int64), self.staging,
                  self.raw.view(torch.uint8), self.copy_stream, ROW_BYTES, chunk_rows, path=path)
        self.uploaded.record(self.copy_stream)
        torch.cuda.current_stream().wait_event(self.uploaded)
        torch.mul(self.raw[:n].to(torch.bfloat16), self.scale.to(torch.bfloat16), out=self.out[:n])

    def split(self, share: float | None = None, chunk_rows: int | None = None):
        def call(ids_cpu):
            n = ids_cpu.numel()
            self.lookups["split"].lookup_split(ids_cpu, self.out[:n], gpu_share=share, chunk_rows=chunk_rows)
        return call

    def memcpy(self, n: int):
        return lambda _ids: memcpy_ceiling(self.dev_bytes[: n * ROW_BYTES], self.host_bytes[: n * ROW_BYTES])

    def close(self) -> None:
        for lk in self.lookups.values():
            lk.close()


def _exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


def _sets_for(n: int) -> int:
    """Id sets for calls of ``n`` ids: enough that the rows of the sets read between two uses of one set
    exceed the host's last-level cache and the GPU's L2 (``SET_ROTATE_BYTES``), from 4 to 256."""
    return max(4, min(256, -(-SET_ROTATE_BYTES // (n * ROW_BYTES))))


def _rotation(dev_sets: torch.Tensor, calls: int):
    """A graph's id buffer of ``calls`` calls (the first sets of ``dev_sets``) and its refresh: before each
    replay, the next ``calls`` sets in rotation, so no set is read twice in a row."""
    device, turn = dev_sets.device, [calls]

    def refresh(buf):
        k = torch.arange(turn[0], turn[0] + buf.shape[0], device=device) % dev_sets.shape[0]
        turn[0] += buf.shape[0]
        buf.copy_(dev_sets[k])

    return dev_sets[torch.arange(calls, device=device) % dev_sets.shape[0]].clone(), refresh


def _time_eager_blocks(calls: dict, sets: list[torch.Tensor], reps: int, rounds: int = 2) -> dict[str, dict]:
    """``_time_eager`` of several calls, each in blocks of consecutive calls, as a serving loop runs one path
    call after call; the blocks take turns over ``rounds`` rounds, so a drift of the machine's state falls
    on all alike; the id sets rotate across every call. (Taken in turn call by call, the split and the
    chunked CPU gather at 1M ids took 26% and 18% longer than in the split sweep of the same run; in
    blocks, the next run's CPU providers were no faster: the eager host timings of the shared machine move
    10-20% from run to run whatever the order, perf/results/h200_2026-12-03/NOTE.md runs 2-3.)"""
    walls = {k: [] for k in calls}
    cpus = {k: [] for k in calls}
    per, turn = max(2, -(-reps // rounds)), 0
    for _ in range(rounds):
        for name, call in calls.items():
            for r in range(per + 2):
                ids = sets[turn % len(sets)]
                turn += 1
                c0, t0 = time.process_time(), time.perf_counter()
                call(ids)
                torch.cuda.current_stream().synchronize()
                if r >= 2:
                    walls[name].append((time.perf_counter() - t0) * 1e6)
                    cpus[name].append((time.process_time() - c0) * 1e6)
    return {k: {"median": statistics.median(walls[k]), "cpu_us": statistics.median(cpus[k])} for k in calls}


def _time_eager(call, sets: list[torch.Tensor], reps: int, cuda: bool, start: int = 0) -> dict[str, float]:
    """Wall and CPU µs per call of ``call(host ids)`` (host work inside: not capturable), to completion; the
    id sets in rotation from ``start``."""
    walls, cpus = [], []
    for r in range(reps + 2):
        ids = sets[(start + r) % len(sets)]
        c0, t0 = time.process_time(), time.perf_counter()
        call(ids)
        if cuda:
            torch.cuda.current_stream().synchronize()
        if r >= 2:
            walls.append((time.perf_counter() - t0) * 1e6)
            cpus.append((time.process_time() - c0) * 1e6)
    return {"median": statistics.median(walls), "cpu_us": statistics.median(cpus)}


def bench(run: Run, ns: list[int], pattern: str, replays: int) -> list[dict]:
    rows, device = run.table.rows, run.device
    recs = []
    for n in command.bar(ns, desc=f"{pattern} ids", unit="point"):
        sets_cpu = [ngram_ids(n, rows, seed=n + k) if pattern == "ngram" else
                    torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(n + k))
                    for k in range(_sets_for(n) if run.cuda else 1)]
        ids = sets_cpu[0].to(device)
        want = reference_rows(run.table, ids, True, run.scale)
        exact = {}
        for name, call in [("ours-auto", run.ours("auto")), ("ours-direct", run.ours("direct")),
                           ("ours-sorted", run.ours("sorted")), ("vllm-peer", run.peer)]:
            run.out[:n].view(torch.int16).fill_(0x7FA5)
            call(ids)
            exact[name] = _exact(run.out[:n], want)
        host_calls = [("cpu-gather", run.cpu_gather)] + \
            ([("cpu-gather-chunked", run.cpu_gather_chunked), ("split", run.split())] if run.cuda else [])
        for name, call in host_calls:
            run.out[:n].view(torch.int16).fill_(0x7FA5)
            call(sets_cpu[0])
            exact[name] = _exact(run.out[:n], want)
        distinct = int(torch.unique(sets_cpu[0]).numel())
        rec = {"pattern": pattern, "n": n, "distinct": distinct, "bit_exact": exact,
               "auto_path": "sorted" if run.lookups["auto"].uses_sorted(n) else "direct"}
        if run.cuda:
            calls = max(2, min(16, (256 << 20) // (n * ROW_BYTES * 3)))
            dev_sets = torch.stack([s.to(device) for s in sets_cpu])

            ids_buf, refresh = _rotation(dev_sets, calls)
            us = {name: graph_replay_us(call, ids_buf, refresh, replays)["median"]
                  for name, call in [("ours-auto", run.ours("auto")), ("ours-direct", run.ours("direct")),
                                     ("ours-sorted", run.ours("sorted")), ("vllm-peer", run.peer),
                                     ("memcpy", run.memcpy(n))]}
            seq_buf = torch.empty(calls, n, dtype=torch.int64, device=device)

            def seq_refresh(buf, n=n):
                start = torch.randint(0, rows - n, (buf.shape[0], 1), device=device)
                buf.copy_(start + torch.arange(n, device=device))

            seq_refresh(seq_buf)
            us["sequential"] = graph_replay_us(run.ours("direct"), seq_buf, seq_refresh, replays)["median"]
            host = _time_eager_blocks({"cpu-gather": run.cpu_gather, "cpu-gather-chunked": run.cpu_gather_chunked,
                                            "split": run.split()}, sets_cpu, max(5, replays // 2))
            cpu, split = host["cpu-gather"], host["split"]
            us.update((k, v["median"]) for k, v in host.items())
            cpu_best = min(us["cpu-gather"], us["cpu-gather-chunked"])  # the better CPU provider decides
            rec["split_cpu_us"] = split["cpu_us"]
            rec.update(us=us, rows_per_s={k: n / (v * 1e-6) for k, v in us.items()}, cpu_gather_cpu_us=cpu["cpu_us"])
            gpu_best = min(us["ours-auto"], us["ours-direct"], us["ours-sorted"])
            rec["ratios"] = {
                "best_path_over_cpu_gather": cpu_best / min(gpu_best, us["split"]),
                "split_over_cpu_gather": cpu_best / us["split"],
                "ours_auto_over_peer": us["vllm-peer"] / us["ours-auto"],
                "ours_sorted_over_peer": us["vllm-peer"] / us["ours-sorted"],
                "ours_auto_over_cpu_gather": cpu_best / us["ours-auto"],
                "best_gpu_over_cpu_gather": cpu_best / gpu_best,
                "ours_auto_of_sequential": us["sequential"] / us["ours-auto"],
                "ours_auto_of_memcpy": us["memcpy"] / us["ours-auto"],
            }
            r = rec["ratios"]
            command.say(f"{pattern:6s} n {n:8d} ({distinct:8d} distinct) auto={rec['auto_path']:6s} "
                  + " ".join(f"{k} {v:9.1f}us" for k, v in us.items())
                  + f" | auto/peer {r['ours_auto_over_peer']:.2f} best/cpu {r['best_path_over_cpu_gather']:.2f} "
                    f"split/cpu {r['split_over_cpu_gather']:.2f} auto/cpu {r['ours_auto_over_cpu_gather']:.2f} "
                    f"of-seq {r['ours_auto_of_sequential']:.2f} cpu-gather cpu {cpu['cpu_us']:.0f}us exact {exact}")
        else:
            command.say(f"{pattern:6s} n {n:8d} ({distinct:8d} distinct) auto={rec['auto_path']}: exact {exact} "
                        "(interpreted: not timed)")
        recs.append(rec)
    return recs


def sweep(run: Run, replays: int) -> list[dict]:
    """Direct vs sorted gathers of raw bytes by row size, table span and n (module docstring)."""
    device = run.device
    flat = run.view.view(torch.uint8).reshape(-1)
    recs = []
    points = [(rb, span, n) for rb in SWEEP_ROW_BYTES
              for span in [flat.numel() if g is None else min(flat.numel(), int(g * GIB)) for g in SWEEP_SPANS_GIB]
              for n in SWEEP_N if n * rb <= SWEEP_MAX_CALL_BYTES and n <= span // rb]
    for rb, span, n in command.bar(points, desc="sweep", unit="point"):
        rows = span // rb
        table = flat[: rows * rb].view(rows, rb)
        out = torch.empty(n, rb, dtype=torch.uint8, device=device)
        ws = torch.empty(2, n, dtype=torch.int64, device=device)
        ids_buf = torch.randint(0, rows, (2, n), device=device)

        def direct(ids, table=table, out=out):
            torch.ops.uvaple.gather_rows(table, ids, out, None, None, 0, False, 0, 0, 0, 0, 0)

        def ordered(ids, table=table, out=out, ws=ws):
            torch.ops.uvaple.gather_rows_sorted(table, ids, out, None, None, ws, 0, False, 0, 0, 0, 0, 0, False)

        ids = ids_buf[0]
        direct(ids)
        a = out.clone()
        out.fill_(0)
        ordered(ids)
        same = torch.equal(a, out)
        refresh = (lambda b, rows=rows: b.random_(0, rows))
        d = graph_replay_us(direct, ids_buf, refresh, replays)["median"]
        s = graph_replay_us(ordered, ids_buf, refresh, replays)["median"]
        rec = {"row_bytes": rb, "span_gib": span / GIB, "n": n, "direct_us": d, "sorted_us": s,
               "sorted_over_direct": d / s, "bit_exact": same,
               "heuristic_sorted": tuning.use_sorted(n, rb, span)}
        command.say(f"sweep rb {rb:6d} span {span / GIB:6.2f} GiB n {n:7d}: direct {d:9.1f} us sorted "
                    f"{s:9.1f} us speedup {d / s:5.2f} heuristic="
                    f"{'sorted' if rec['heuristic_sorted'] else 'direct'} exact {same}")
        recs.append(rec)
    return recs


# The sorted kernel's program shapes: (sorted ids per program, warps, de-duplication). One row per program
# with more warps keeps fewer rows in flight per SM (64 warps an SM: 4 warps, 16 programs; 16 warps, 4),
# so the rows in flight at once lie in a narrower stretch of the sorted order.
SHAPES = [(1, 1, False), (1, 2, False), (1, 4, False), (1, 8, False), (1, 16, False), (1, 32, False),
          (2, 8, False), (4, 16, False), (4, 4, True), (16, 4, True), (16, 16, True)]
DIRECT_WARPS = (1, 2, 4, 8, 16)  # the direct kernel's warps per program (one 160-row tile each)
SHAPE_N = (16384, 65536, 262144, 1048576)


def _cold_sets(run: Run, n: int, calls: int):
    """Device id buffer for ``calls`` calls of ``n`` random ids and its refresh: the next sets of a rotation
    over ``_sets_for(n)`` sets (as :func:`bench`), so every timed call reads rows from DRAM."""
    g = torch.Generator(device=run.device).manual_seed(n)
    return _rotation(torch.randint(0, run.table.rows, (_sets_for(n), n), device=run.device, generator=g), calls)


def shape_sweep(run: Run, replays: int) -> list[dict]:
    """The lookup's own sorted call (fp8 rows dequantised to bf16, row keys, its sort) by program shape
    (``SHAPES``), the direct kernel by warps (``DIRECT_WARPS``) and the vLLM-shape peer, random ids over the
    whole table, cold rows (:func:`_cold_sets`), each output compared bit for bit with the shipped call's."""
    from uvaple.kernels.gather import DirectGather
    from uvaple.kernels.gather_sorted import SortedGather
    from uvaple.kernels.tuning import LaunchConfig, SortedConfig

    lk = run.lookups["sorted"]
    spec, recs = lk.spec, []
    ws = lk._workspace
    # the lookup's table view and policy, no counters; a launcher per program shape, made once
    policy = dict(dq_scale=lk._dq_scale, bits=spec.scale_arg, has_scale=spec.has_scale, id_base=spec.id_offset,
                  row_lo=lk._row_lo, oob_mode=spec.oob_mode, dequant=spec.dequant)
    shaped = {f"sorted r{rows} w{warps}{' dedup' if dedup else ''}":
              SortedGather(lk._arg, run.device, spec.output_dtype, ws, dedup=dedup,
                           config=SortedConfig(rows, 256, warps), **policy) for rows, warps, dedup in SHAPES}
    shaped.update({f"direct w{warps}": DirectGather(lk._arg, run.device, spec.output_dtype,
                                                    config=LaunchConfig(256, warps), **policy)
                   for warps in DIRECT_WARPS})

    def launched(launcher):
        def call(ids):
            n = ids.numel()
            launcher(ids, run.out[:n], 0, n)
        return call

    for n in command.bar([n for n in SHAPE_N if n <= run.out.shape[0]], desc="shape sweep", unit="n"):
        calls = max(2, min(16, (256 << 20) // (n * ROW_BYTES * 3)))
        ids_buf, refresh = _cold_sets(run, n, calls)
        out, check = run.out[:n], ids_buf[0].clone()  # (the timing rewrites ids_buf)
        lk.lookup(check, out)
        want = out.clone()
        variants = {"shipped-sorted": run.ours("sorted"), "shipped-direct": run.ours("direct"), "vllm-peer": run.peer}
        variants.update((name, launched(launcher)) for name, launcher in shaped.items())
        recs += _time_variants("shape", n, {k: (v, True) for k, v in variants.items()}, ids_buf, refresh, check,
                               out, want, replays)
    return recs


def _time_variants(kind: str, n: int, variants: dict, ids_buf, refresh, check, out, want, replays: int) -> list[dict]:
    """Each of ``variants`` (name -> (call, whether it writes ``out``)) checked bit for bit against ``want`` on
    the ids ``check`` (poisoned output first), then timed in a CUDA graph over the rotating ``ids_buf``."""
    recs = []
    for name, (call, writes) in variants.items():
        out.view(torch.int16).fill_(0x7FA5)
        call(check)
        exact = torch.equal(out.view(torch.int16), want.view(torch.int16)) if writes else None
        t = graph_replay_us(call, ids_buf, refresh, replays)
        recs.append({"n": n, "variant": name, "us": t["median"], "p20": t["p20"], "p80": t["p80"], "bit_exact": exact})
        command.say(f"{kind} n {n:8d} {name:34s}: {t['median']:9.1f} us (p20 {t['p20']:9.1f} p80 {t['p80']:9.1f}) "
                    f"{n / t['median']:7.1f} M rows/s exact {exact}")
    return recs


SORT_N = (16384, 65536, 262144, 1048576)


def _sort_calls(run: Run, n: int) -> dict:
    """:func:`sort_sweep`'s calls for ``n`` ids: name -> (call, writes the output)."""
    from uvaple.kernels.gather_sorted import SortedGather, sorted_launch_config

    lk = run.lookups["sorted"]
    spec, ws, rows = lk.spec, lk._workspace, lk._arg.shape[0]
    shipped = lk.plan.sorted  # the lookup's sorted launcher: its sort is the shipped one
    shift = max(0, rows.bit_length() - 15)  # bucket keys below 2**15
    order = ws[1, :n]
    k16 = torch.empty(n, dtype=torch.int16, device=run.device)
    s16 = torch.empty(n, dtype=torch.int16, device=run.device)
    ids_sorted = torch.empty(n, dtype=torch.int64, device=run.device)
    # the gather kernel over ids in an order of our own, the ids as given (keys=False), no counters, one row a
    # program (the shape sorted_launch_config gives the lookup's non-dedup call)
    on_ids = SortedGather(lk._arg, run.device, spec.output_dtype, ws, dq_scale=lk._dq_scale, bits=spec.scale_arg,
                          has_scale=spec.has_scale, id_base=spec.id_offset, row_lo=lk._row_lo, oob_mode=spec.oob_mode,
                          dequant=spec.dequant, keys=False)
    cfg = sorted_launch_config(lk._arg, run.device, n, ROW_BYTES, 0, False)

    def sort32(ids):
        shipped.sort(ids, n)  # row_keys_kernel, then torch's sort of the 4-byte keys (into the workspace)

    def sort16(ids):
        torch.bitwise_right_shift(ids, shift, out=ids_sorted)
        k16.copy_(ids_sorted)
        torch.sort(k16, stable=False, out=(s16, order))

    def bucket16(ids):
        sort16(ids)
        torch.take(ids, order, out=ids_sorted)
        on_ids.gather_ordered(ids_sorted, order, run.out[:n], 0, cfg)

    return {"shipped-sorted": (run.ours("sorted"), True), "sort only: row keys int32": (sort32, False),
            f"sort only: buckets int16 (>>{shift})": (sort16, False), "sorted on int16 buckets": (bucket16, True)}


def sort_sweep(run: Run, replays: int) -> list[dict]:
    """What the sorted call's sort costs, and whether coarser keys cost less (random ids, cold rows, CUDA
    graphs): the shipped call; its sort alone (``row_keys_kernel`` + torch's sort of 4-byte row keys); int16
    bucket keys (``row >> shift``, buckets of ``2**shift`` rows) sorted alone; and the whole call on bucket
    order (int16 keys, the ids taken in that order, the gather kernel on them as given), compared bit for bit
    with the shipped call's output."""
    lk, recs = run.lookups["sorted"], []
    for n in command.bar([n for n in SORT_N if n <= run.out.shape[0]], desc="sort sweep", unit="n"):
        calls = max(2, min(16, (256 << 20) // (n * ROW_BYTES * 3)))
        ids_buf, refresh = _cold_sets(run, n, calls)
        out, check = run.out[:n], ids_buf[0].clone()
        lk.lookup(check, out)
        want = out.clone()
        recs += _time_variants("sort", n, _sort_calls(run, n), ids_buf, refresh, check, out, want, replays)
    return recs


SPLIT_SHARES = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45)
SPLIT_CHUNKS = (0, 16384, 32768, 65536)  # rows per copy up (0: the whole share at once)
SPLIT_N = (16384, 65536, 262144, 1048576)


def split_sweep(run: Run, reps: int) -> list[dict]:
    """The split path by GPU share, chunk rows and n (random ids): the data behind ``placements.split.SPLIT_PLAN``."""
    recs = []
    ns = [n for n in SPLIT_N if n <= run.out.shape[0]]
    progress = command.bar(total=len(ns) * len(SPLIT_CHUNKS), desc="split sweep", unit="chunking")
    for n in ns:
        sets = [torch.randint(0, run.table.rows, (n,), generator=torch.Generator().manual_seed(99 + k))
                for k in range(_sets_for(n))]
        turn = 0  # the sets in rotation across the whole sweep of this n
        for chunk in SPLIT_CHUNKS:
            for share in SPLIT_SHARES:
                t = _time_eager(run.split(share, chunk or n), sets, reps, True, turn)
                turn += reps + 2
                recs.append({"n": n, "gpu_share": share, "chunk_rows": chunk or n, "us": t["median"],
                             "cpu_us": t["cpu_us"]})
                command.say(f"split n {n:8d} gpu share {share:.2f} chunk {chunk or n:8d}: {t['median']:9.1f} us "
                            f"(cpu {t['cpu_us']:.0f} us)")
            for path in ("parallel", "prefetch", "torch"):
                t = _time_eager(lambda i, c=chunk or n, p=path: run.cpu_gather_chunked(i, c, p), sets, reps, True,
                                turn)
                turn += reps + 2
                recs.append({"n": n, "cpu_gather_chunk_rows": chunk or n, "cpu_path": path, "us": t["median"],
                             "cpu_us": t["cpu_us"]})
                command.say(f"cpu-gather-chunked n {n:8d} chunk {chunk or n:8d} {path:8s}: {t['median']:9.1f} us "
                            f"(cpu {t['cpu_us']:.0f} us)")
            progress.update(1)
    progress.close()
    return recs


def _plot(recs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, pattern in zip(axes, ("random", "ngram"), strict=True):
        rs = [r for r in recs if r["pattern"] == pattern and "rows_per_s" in r]
        if not rs:
            continue
        for name in rs[0]["rows_per_s"]:
            ax.plot([r["n"] for r in rs], [r["rows_per_s"][name] / 1e6 for r in rs], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rows per call")
        ax.set_ylabel("M rows/s")
        ax.set_title(f"160-B fp8 rows, {pattern} ids")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="uvaple bench --workload ngram",
        description="160-byte fp8 rows at random over a big table, the n-gram PLE shape: our gather (auto, direct, "
                    "sorted) against vLLM's kernel shape, a CPU gather, the split path and the memcpy ceiling, each "
                    "checked bit for bit, then timed in CUDA graphs. Needs a CUDA GPU; --smoke runs it small on the "
                    "CPU.",
        epilog=command.EXIT_STATUSES.replace("every output agreed", "every provider bit-exact")
        + " Progress goes to stderr, results to stdout and --out.")
    p.add_argument("--table-gib", type=command.number(meaning="GiB"),
                   help=f"table size in GiB (default {TABLE_GIB:g}; must fit in free host memory; --smoke sets its "
                        f"own, a {SMOKE_ROWS:,}-row table)")
    p.add_argument("--rows", type=command.positive_ints, default=list(N_DEFAULT),
                   help=f"ids per call, comma-separated (default {','.join(map(str, N_DEFAULT))}; --smoke keeps "
                        f"those up to {SMOKE_MAX_N:,}, else 256)")
    p.add_argument("--patterns", default="random,ngram",
                   help="id streams, comma-separated: random, ngram (default both; empty: the sweeps alone)")
    p.add_argument("--sweep", action="store_true",
                   help="also the direct/sorted sweep by row size, span and n, and the split and shape sweeps (GPU)")
    p.add_argument("--split-sweep", action="store_true", help="also the split sweep (GPU share x chunk rows) (GPU)")
    p.add_argument("--shape-sweep", action="store_true", help="also the kernels' program shapes, cold rows (GPU)")
    p.add_argument("--sort-sweep", action="store_true", help="also the sorted call's sort alone and coarser keys (GPU)")
    p.add_argument("--replays", type=command.number(int, meaning="a count"), default=20,
                   help="CUDA-graph replays per timed point (default 20)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a small run on the CPU on any machine: a {SMOKE_ROWS:,}-row table, interpreted kernels, "
                        "correctness only, no timing (about a minute on 2 cores)")
    p.add_argument("--out", help="directory for ngram.json (and ngram_rows.png on a GPU), made and checked "
                                 "writable before any work (default ./uvaple-results/<UTC time>_ngram_<gpu or "
                                 "cpu>/)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p.parse_args(argv)


def check_runnable(a: argparse.Namespace) -> None:
    """Refuse (:class:`command.Refused`) what this machine cannot run, before anything is built."""
    sweeps = [f"--{f.replace('_', '-')}" for f in SWEEP_FLAGS if getattr(a, f)]
    if a.smoke and a.table_gib is not None:
        raise command.Refused(f"--smoke sets its own table ({SMOKE_ROWS:,} rows); --table-gib {a.table_gib:g} would be "
                              "ignored: drop it, or drop --smoke to time that table on a GPU")
    if a.table_gib is None:
        a.table_gib = TABLE_GIB
    if a.smoke:
        if sweeps:
            raise command.Refused(f"{', '.join(sweeps)} {'time' if len(sweeps) > 1 else 'times'} CUDA graphs on a "
                                  f"GPU; --smoke runs on the CPU: drop {' and '.join(sweeps)} or --smoke")
    else:
        command.needs_cuda("the ngram workload (it times CUDA graphs)",
                           "--smoke runs it small on the CPU (correctness only, about a minute)")
    rows = SMOKE_ROWS if a.smoke else int(a.table_gib * GIB) // ROW_BYTES
    if rows < 1:
        raise command.Refused(f"--table-gib {a.table_gib} holds no {ROW_BYTES}-byte row: give a positive size")
    fits = (system.mem_available_bytes() or 0) * 0.9 / GIB  # leave a tenth for the run's buffers
    command.check_fits(rows * ROW_BYTES, f"a {a.table_gib:g} GiB table (--table-gib)",
                       f"Pass a smaller --table-gib (at most about {fits:.0f} GiB here), or --smoke for the small "
                       "CPU run")


def main(argv: list[str] | None = None) -> int:
    prog = "uvaple bench --workload ngram"
    a = parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    try:
        check_runnable(a)
        out = command.workload_out("ngram", a.out, cuda)
    except command.Refused as e:
        return command.refuse(prog, e)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ns = a.rows
    if a.smoke:
        ns = [n for n in ns if n <= SMOKE_MAX_N] or [256]
    if cuda:
        torch.set_num_threads(min(16, os.cpu_count() or 1))
    with command.progress(not a.quiet):
        return _run(a, ns, cuda, device, out)


def _run(a: argparse.Namespace, ns: list[int], cuda: bool, device: torch.device, out) -> int:
    t0 = time.perf_counter()
    table = make_table(a.table_gib, a.smoke)
    command.say(f"# {table.rows:,} rows of {ROW_BYTES} B fp8 ({table.rows * ROW_BYTES / GIB:.2f} GiB), ready and "
                f"filled in {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}; "
                f"{'CUDA graphs' if cuda else 'interpreted, not timed'}")
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "table_gib": a.table_gib,
           "table_rows": table.rows, "smoke": a.smoke, "row_bytes": ROW_BYTES,
           "heuristic": {k: getattr(tuning, k) for k in HEURISTIC_NAMES},
           "split_plan": [list(x) for x in split_plan.SPLIT_PLAN],
           "results": [], "sweep": [], "split_sweep": [], "shape_sweep": [], "sort_sweep": []}
    run = Run(table, max(ns), device)
    try:
        with command.kept_on_failure(out, "ngram.json", doc):
            for pattern in filter(None, (x.strip() for x in a.patterns.split(","))):  # "": the sweeps alone
                doc["results"] += bench(run, ns, pattern, a.replays)
            reps = max(5, a.replays // 2)
            if a.sweep and cuda:
                doc["sweep"] = sweep(run, reps)
            if (a.sweep or a.split_sweep) and cuda:
                doc["split_sweep"] = split_sweep(run, reps)
            if (a.sweep or a.shape_sweep) and cuda:
                doc["shape_sweep"] = shape_sweep(run, reps)
            if a.sort_sweep and cuda:
                doc["sort_sweep"] = sort_sweep(run, reps)
    finally:
        run.close()
        table.close()
    bad = [r for r in doc["results"] if not all(r["bit_exact"].values())] + \
        [r for k in ("sweep", "shape_sweep", "sort_sweep") for r in doc[k] if r["bit_exact"] is False]
    written = [command.write_json(out, "ngram.json", doc)]
    if cuda:
        _plot(doc["results"], os.path.join(out, "ngram_rows.png"))
        written += [out / "ngram_rows.png"] if (out / "ngram_rows.png").exists() else []
    if bad:
        print(f"NOT BIT-EXACT: {len(bad)} points", file=sys.stderr)
    command.wrote(out, written)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
