"""``uvaple bench --workload host``: what one eager call costs the host, next to torch's own ops.

Eager calls are what transformers' ``generate()`` and vLLM's prefill outside CUDA graphs make; at a decode
step's few rows the device work is a few microseconds, so the host's time is the call's time. Every
provider gathers the same rows of the same registered host table (``--cols`` bf16 columns) into the same
``out``:

* ``lookup``: ``make_lookup("uva", table).lookup(ids, out)``: on a GPU the eager C call
  (:mod:`uvaple.kernels.eager_call`: the call's checks and its launch below Python), elsewhere the Python path;
* ``alloc``: ``lookup(ids)``, its ``out`` allocated (``torch.empty``) by the call, as ``F.embedding``'s is;
* ``python``: the same call on the Python path (a lookup whose C call is off): the lookup's per-call checks,
  then its plan's launch (the compiled kernel kept per call key);
* ``operator``: ``torch.ops.uvaple.gather_rows(..., plan)``, the call a compiled model makes (the
  dispatcher, the operator's checks of what the call brings, the same plan's launch);
* ``gather_rows``: the functional entry point (every check and a launcher made for every call);
* ``plan``: the lookup's plan alone (``lk.plan.run(ids, out)``: the size class and the launcher, no checks);
* ``direct``: the plan's direct gather alone (``lk.plan.direct(ids, out, 0, n)``: the capture check, the call
  key, the current device and the launch-hook check, then the launch);
* ``bare``: the same compiled kernel launched with every argument bound (``DirectGather.bare``): the floor
  of a Triton launch; ``lookup - bare`` is what the lookup adds above it (goal: 3 us at every row count), and
  ``lookup``, ``plan``, ``direct``, ``bare`` in turn say which layer adds it;
* ``index_select``: ``torch.index_select(view, 0, ids, out=out)`` over ``table.cuda_view()``: the bar;
* ``embedding``: ``F.embedding(ids, view)`` (allocates its output, as people use it).

On a GPU the run then times, each alone, what the direct gather asks per call before it launches (the current
device, the current stream, the capture state, the launch hooks) beside an empty call (the timer's floor):
``queries`` in the JSON, which part of ``direct - bare`` the CUDA runtime takes.

Method: the host time of each call is ``time.perf_counter`` around it alone; the device is synchronised
every ``--sync-every`` calls outside the timed region, so the launch queue never fills (a full queue would
make a launch wait for the GPU). The providers take turns in blocks of ``--block`` calls, ``--calls`` calls
each per row count; the figure is the median call, with p20/p80. Outputs are compared bit for bit with
``index_select``'s first. ``--smoke`` runs the same code small on CPU tensors (interpreted): a correctness
run, not a host-cost figure; without CUDA nothing else runs.

``--stub-launch`` (any machine, no GPU): the project's own Python above Triton's launcher, alone. The lookup is
built on the CPU, its rows checked once (interpreted), then the compiled kernel of the call's key is stood in for
by a no-op and the current device and stream by constants: ``lookup``, ``plan`` and ``direct`` run every line of
their own, and ``bare`` is the no-op called with every argument bound. ``lookup - bare`` is then what the
lookup's layers cost this host's Python; a GPU's figure adds the CUDA calls (the capture state, the current
device and stream: about 1 us on the H200's host) and Triton's launcher, which ``bare`` times there.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from . import command
from .timing import quantiles

PROVIDERS = ("lookup", "alloc", "python", "operator", "gather_rows", "plan", "direct", "bare", "index_select",
             "embedding")


def _providers(h, lk, lk_py, view, ids: torch.Tensor, out: torch.Tensor) -> dict:
    from uvaple.kernels import gather_rows

    plan = lk.plan
    handle = plan.handle
    spec = lk.spec
    table = lk._arg
    policy = (spec.scale_arg, spec.has_scale, 0, spec.id_offset, 0, spec.oob_mode, spec.dequant)
    counters = lk._counters
    lk.lookup(ids, out)  # the call key's compiled kernel, which the bare launch binds (and the C call is taught)
    lk.lookup(ids)
    bare = plan.direct.bare(ids, out)
    return {
        "lookup": lambda: lk.lookup(ids, out),
        "alloc": lambda: lk.lookup(ids),
        "python": lambda: lk_py.lookup(ids, out),
        "operator": lambda: torch.ops.uvaple.gather_rows(table, ids, out, counters, None, *policy, handle),
        "gather_rows": lambda: gather_rows(view, ids, out),
        "plan": lambda: plan.run(ids, out),
        "direct": lambda: plan.direct(ids, out, 0, ids.numel()),
        "bare": bare,
        "index_select": lambda: torch.index_select(view, 0, ids, out=out),
        "embedding": lambda: torch.nn.functional.embedding(ids, view),
    }


STUBBED = ("lookup", "plan", "direct", "bare")  # --stub-launch's providers (on the CPU "lookup" is the Python path)


def _queries(device: int) -> dict:
    """What the plan's direct gather asks per call before it launches (``kernels/launch.py``,
    ``kernels/capture.py``), each alone, and the timer's own floor (``nothing``): which of ``direct - bare`` is
    the CUDA runtime's and which is Python's. Needs the launcher loaded (a compiled launch made first)."""
    from uvaple.kernels import capture
    from uvaple.kernels import launch as launch_mod

    driver = launch_mod._Driver
    return {"nothing": lambda: None, "current_device": driver.device, "current_stream": lambda: driver.stream(device),
            "capturing": capture._stream_capturing, "hooks": launch_mod._Hooks.set}


@contextlib.contextmanager
def stubbed_launch(lk, ids: torch.Tensor, out: torch.Tensor):
    """Within: the lookup's call ``lk.lookup(ids, out)`` finds a no-op kept as the compiled kernel of its key, and
    Triton's current device and stream are constants (``--stub-launch``); everything is put back on leaving."""
    from uvaple.kernels import launch as launch_mod

    launch, _, _, key, device = lk.plan.direct.launch_of(ids, out)
    driver = launch_mod._Driver
    saved = launch.interpret, dict(launch._compiled), vars(driver)["device"], vars(driver)["stream"]
    launch.interpret = False
    launch.keep(device, key, lambda *args: None, None, None, None)
    driver.device, driver.stream = staticmethod(lambda: device), staticmethod(lambda index: 0)
    try:
        yield
    finally:
        launch.interpret, driver.device, driver.stream = saved[0], saved[2], saved[3]
        launch._compiled.clear()
        launch._compiled.update(saved[1])


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(fns: dict, calls: int, block: int, sync_every: int, cuda: bool) -> dict[str, list[float]]:
    """Host microseconds of each call of each provider (taking turns in blocks)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm: compile, first launches, caches
        for _ in range(20):
            fn()
    _sync(cuda)
    done = 0
    while done < calls:
        for name, fn in fns.items():
            ts = times[name]
            for i in range(min(block, calls - done)):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
                if (i + 1) % sync_every == 0:
                    _sync(cuda)
            _sync(cuda)
        done += block
    return times


def run(a, result: dict | None = None) -> dict:
    """Every provider at every row count of ``a.rows``; the figures go into ``result`` (a new dict by default)
    as they are made, so a caller keeps what a failed run measured."""
    from uvaple.integration import make_lookup
    from uvaple.kernels import eager_call
    from uvaple.uva import HostTable

    cuda = torch.cuda.is_available() and not a.smoke and not a.stub_launch  # the CPU, as every workload's smoke
    device = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(a.table_rows, a.cols, generator=g) * 3).to(torch.bfloat16)
    result = {} if result is None else result
    on = "cpu (interpreted: not a host-cost figure)" if not a.stub_launch else \
        "cpu, launch stubbed (the project's Python above Triton's launcher)"
    result.update({"device": torch.cuda.get_device_name() if cuda else on, "stub_launch": a.stub_launch,
                   "torch": torch.__version__, "cols": a.cols, "table_rows": a.table_rows, "calls": a.calls,
                   "eager_call": (eager_call.unavailable() or "used") if cuda else "not on the CPU", "rows": {}})
    with HostTable.from_tensor(src) as h:
        view = h.cuda_view() if cuda else h.tensor
        with make_lookup("uva", h, device=device) as lk, make_lookup("uva", h, device=device) as lk_py:
            if lk_py._eager is not None:  # the Python path alone: this lookup's C call off
                lk_py._eager.close()
                lk_py._eager = None
            for n in command.bar(a.rows, desc="ids per call", unit="n"):
                ids = torch.randint(0, a.table_rows, (n,), generator=g).to(device)
                out = torch.empty(n, a.cols, dtype=torch.bfloat16, device=device)
                fns = _providers(h, lk, lk_py, view, ids, out)
                want = torch.index_select(view, 0, ids).view(torch.int16).cpu()
                exact = {}
                for name, fn in fns.items():
                    out.fill_(float("nan"))
                    got = fn()
                    got = out if got is None else got
                    exact[name] = bool(torch.equal(got.view(torch.int16).cpu(), want))
                if a.stub_launch:  # rows checked above, interpreted; now only the Python above the launch
                    with stubbed_launch(lk, ids, out):
                        fns = {k: v for k, v in fns.items() if k in STUBBED}
                        fns["bare"] = lk.plan.direct.bare(ids, out)
                        times = measure(fns, a.calls, a.block, a.sync_every, cuda)
                else:
                    times = measure(fns, a.calls, a.block, a.sync_every, cuda)
                row = {}
                for name, ts in times.items():
                    p20, med, p80 = quantiles(ts)
                    row[name] = {"median_us": round(med, 2), "p20_us": round(p20, 2), "p80_us": round(p80, 2),
                                 "mean_us": round(statistics.fmean(ts), 2), "exact": exact[name]}
                if "index_select" in row:
                    bar = row["index_select"]["median_us"]
                    for name in row:
                        row[name]["x_index_select"] = round(row[name]["median_us"] / bar, 2)
                row["lookup"]["above_bare_us"] = round(row["lookup"]["median_us"] - row["bare"]["median_us"], 2)
                result["rows"][str(n)] = row
                if lk._eager is not None:
                    result["eager_call_stats"] = {**lk._eager.stats(), "taught": lk._eager.taught()}
                command.say(_line(n, row))
            if cuda:  # the launcher is loaded now (the rows above launched compiled kernels)
                times = measure(_queries(torch.cuda.current_device()), a.calls, a.block, a.sync_every, cuda)
                result["queries"] = {name: dict(zip(("p20_us", "median_us", "p80_us"),
                                                    (round(q, 3) for q in quantiles(ts)), strict=True))
                                     for name, ts in times.items()}
                command.say("# the direct gather's per-call queries, each alone (median us): " + ", ".join(
                    f"{name} {q['median_us']:.2f}" for name, q in result["queries"].items()))
    return result


def _line(n: int, row: dict) -> str:
    cells = " ".join(f"{row[p]['median_us']:>9.2f}{'' if row[p]['exact'] else '!'}" for p in PROVIDERS if p in row)
    ratios = f" {row['lookup']['x_index_select']:>10.2f} {row['operator']['x_index_select']:>10.2f}" \
        if "index_select" in row else ""
    return f"{n:>6} {cells}{ratios} {row['lookup']['above_bare_us']:>10.2f}"


SMOKE = {"calls": 40, "block": 10, "table_rows": 512, "cols": 64, "rows": [1, 7]}  # --smoke: ~10 s on 2 cores
DEFAULTS = {"calls": 2000, "block": 100, "table_rows": 65536, "cols": 2048, "rows": [1, 64, 1024]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="uvaple bench --workload host",
        description="What one eager call costs the host: the lookup, the operator, the functional gather, the plan "
                    "alone and the bare launch (the floor), torch's index_select and embedding, over the same "
                    "registered host table. Needs a CUDA GPU; --smoke "
                    "runs it small on the CPU.",
        epilog=command.EXIT_STATUSES.replace("every output agreed", "every provider gave index_select's rows")
        + " Progress goes to stderr, results to stdout and --out.")
    count = command.number(int, meaning="a count")
    p.add_argument("--rows", type=command.positive_ints, help="ids per call, comma-separated (default 1,64,1024)")
    p.add_argument("--cols", type=count, help="bf16 columns of a row (default 2048)")
    p.add_argument("--table-rows", type=count, help="rows of the host table (default 65536)")
    p.add_argument("--calls", type=count, help="timed calls per provider and row count (default 2000)")
    p.add_argument("--block", type=count, help="calls of one provider before the next takes its turn (default 100)")
    p.add_argument("--sync-every", type=count, default=8, help="calls between device synchronisations (default 8)")
    p.add_argument("--smoke", action="store_true",
                   help=f"a small run on the CPU on any machine: {SMOKE['calls']} calls at 1 and 7 ids on a "
                        f"{SMOKE['table_rows']}-row table of {SMOKE['cols']} columns, interpreted kernels, "
                        "correctness only (about 10 s); it sets the sizes above itself")
    p.add_argument("--stub-launch", action="store_true",
                   help="any machine, no GPU: the lookup's own Python above Triton's launcher, with the compiled "
                        "kernel stood in for by a no-op (lookup, plan, direct, bare; rows checked once, "
                        "interpreted); the sizes default to --smoke's but for --calls")
    p.add_argument("--out", help="directory for host_cost.json, made and checked writable before any work "
                                 "(default ./uvaple-results/<UTC time>_host_<gpu or cpu>/)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p.parse_args(argv)


def main(argv=None) -> int:
    prog = "uvaple bench --workload host"
    a = parse_args(argv)
    try:
        given = [f"--{k.replace('_', '-')}" for k in SMOKE if getattr(a, k) is not None]
        if a.smoke and given:
            raise command.Refused(f"--smoke sets its own sizes; {', '.join(given)} would be ignored: drop "
                                  f"{'them' if len(given) > 1 else 'it'}, or drop --smoke to run the sizes given")
        if a.smoke and a.stub_launch:
            raise command.Refused("--smoke and --stub-launch are two runs: --smoke checks the rows of every "
                                  "provider, --stub-launch times the lookup's Python with the launch stubbed; "
                                  "pick one")
        sizes = dict(SMOKE, calls=DEFAULTS["calls"]) if a.stub_launch else SMOKE if a.smoke else DEFAULTS
        vars(a).update({k: v for k, v in sizes.items() if getattr(a, k) is None})
        if not a.smoke and not a.stub_launch:
            command.needs_cuda("the host workload (it times GPU launches)",
                               "--smoke runs it small on the CPU (correctness only, about 10 s)")
        # the random source and the host table made from it
        command.check_fits(2 * a.table_rows * a.cols * 2, f"a {a.table_rows:,} x {a.cols:,} bf16 table (and its "
                           "source)", "Pass a smaller --table-rows or --cols, or --smoke")
        out = command.workload_out("host", a.out, not a.smoke and not a.stub_launch)
    except command.Refused as e:
        return command.refuse(prog, e)
    if a.smoke:
        command.say("# CPU run (--smoke): interpreted kernels on CPU tensors; the times below are the interpreter's, "
                    "not a GPU's host cost: this run checks the rows")
    command.say(f"# host us per eager call (median of {a.calls}); rows of {a.cols} bf16 columns; "
                "'!' marks a provider whose rows differ from index_select's")
    if a.stub_launch:
        command.say("# CPU run (--stub-launch): the compiled launch is a no-op; the times are this host's Python "
                    "above Triton's launcher (a GPU adds its CUDA calls and the launcher itself)")
        command.say(f"{'ids':>6} " + " ".join(f"{p[:9]:>9}" for p in STUBBED) + f" {'lk-bare us':>10}")
    else:
        command.say(f"{'ids':>6} " + " ".join(f"{p[:9]:>9}" for p in PROVIDERS) + f" {'lookup/is':>10} "
                    f"{'op/is':>10} {'lk-bare us':>10}")
    result: dict = {"smoke": a.smoke}
    with command.progress(not a.quiet):
        with command.kept_on_failure(out, "host_cost.json", result):
            run(a, result)
    path = command.write_json(out, "host_cost.json", result)
    bad = [(n, p) for n, row in result["rows"].items() for p, r in row.items() if not r["exact"]]
    if bad:
        print(f"MISMATCH: {bad}", file=sys.stderr)
    command.wrote(out, [path])
    return 1 if bad else 0
