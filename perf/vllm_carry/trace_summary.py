"""Where a decode step's time goes, from a torch-profiler trace of vLLM's engine (``decode_bench.py --profile``).

``python3 perf/vllm_carry/trace_summary.py NAME=TRACE.json.gz [NAME=TRACE ...] [--json OUT]`` prints one
summary per trace and, for two or more, the table that sets them side by side. Runs anywhere (no vLLM, no GPU).

A trace (Chrome format, as ``torch.profiler`` writes it) is cut into steps at the annotation vLLM's worker
records around each ``execute_model`` while its profiler runs, ``execute_context_C(T)_generation_G(T)`` (C
requests in prefill, G decoding; both model runners). A step with a request in prefill is a prefill step, one
without is a decode step; the decode steps are the longest run of them in a row, less the last (the profiler
stops in it). A trace without those annotations is cut at the V1 model runner's ``gpu_model_runner: forward``
(recorded with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``), the first step taken as the prefill. Over the decode
steps:

* the step: median and spread of the time between two steps' starts (the host's period, which is the GPU's when
  the GPU is never idle);
* the GPU: time busy per step (the union of kernel and memcpy intervals in the window, so overlapping streams count
  once) and idle per step, and the longest idle gaps with the kernels either side (where the GPU waited for the
  host, or for a copy);
* the host: the median duration of each model-runner annotation per step, and the CUDA runtime calls per step
  (graph launches, kernel launches, copies, synchronisations) with their time;
* the kernels: time and launches per step of each (by name), the largest first;
* the prefill (the first step, left out above; where time to first token goes): its host time, and the GPU
  time and the largest kernels of those that started while it ran on the host (a kernel still queued when the
  next step starts is counted there, so compare configurations, not absolute figures).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import sys
from collections import defaultdict

WORKER_STEP = re.compile(r"^execute_(?:\d+_)?context_(\d+)\(.*?\)_generation_(\d+)\(")  # the worker's, per step
STEP_MARK = "gpu_model_runner: forward"  # the V1 model runner's, with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CALLS = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                 "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize", "cudaEventSynchronize",
                 "cudaDeviceSynchronize", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventQuery")
KEPT_CATS = (*GPU_CATS, "user_annotation", "cuda_runtime", "cuda_driver")  # all that summarize reads


class TraceError(ValueError):
    """The trace cannot be summarised (not a torch-profiler trace, or too few steps)."""


def load(path: str) -> list[dict]:
    """The complete (``ph == "X"``) events of a Chrome trace, ``.json`` or ``.json.gz``."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a readable Chrome trace ({type(e).__name__}: {e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "n": len(values)}


def trim(events: list[dict]) -> list[dict]:
    """What :func:`summarize` reads of ``events`` (kernels, copies, annotations, runtime calls), so that a trace
    too large to bring back can come back as this."""
    return [e for e in events if e.get("cat") in KEPT_CATS]


def save(events: list[dict], path: str) -> int:
    """``events`` as a gzipped Chrome trace at ``path``; its size in bytes."""
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f, separators=(",", ":"))
    return os.path.getsize(path)


def step_marks(events: list[dict]) -> list[tuple[float, str, str]]:
    """The steps of a trace, in order: (start us, "prefill" or "decode", the annotation's name). The worker's step
    annotations where the trace has them, else the V1 model runner's (the first taken as the prefill)."""
    worker = sorted((float(e["ts"]), e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and WORKER_STEP.match(e.get("name", "")))
    if worker:
        return [(t, "prefill" if int(WORKER_STEP.match(n).group(1)) else "decode", n) for t, n in worker]
    runner = sorted(float(e["ts"]) for e in events if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation")
    return [(t, "decode" if i else "prefill", STEP_MARK) for i, t in enumerate(runner)]


def summarize(events: list[dict], top: int = 25, gaps: int = 8) -> dict:
    """The decode steps of ``events`` (times in microseconds; see the module docstring)."""
    cut = step_marks(events)
    run: list[float] = []  # the longest run of decode steps in a row
    current: list[float] = []
    for t, kind, _ in cut:
        if kind != "decode":
            current = []
            continue
        current.append(t)
        if len(current) > len(run):
            run = current
    starts = run[:-1]  # the last decode step is left out: the profiler stops in it
    if len(starts) < 2:
        raise TraceError(f"no whole decode step annotated ({len(cut)} steps in all): a decode profile needs two "
                         "decode steps in a row and the start of a third (vLLM's worker names each step "
                         "execute_context_..._generation_... while its profiler runs; the V1 model runner's "
                         f"'{STEP_MARK}' needs VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 in the engine's environment)")
    lo, hi = starts[0], starts[-1]
    steps = len(starts) - 1
    periods = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
                 if e.get("cat") in GPU_CATS and lo <= float(e["ts"]) < hi)
    busy = _union([(s, min(t, hi)) for s, t, _ in gpu])
    busy_us = sum(t - s for s, t in busy)
    idle = []  # (length, where it starts)
    for (_s0, e0), (s1, _e1) in zip(busy, busy[1:], strict=False):
        if s1 > e0:
            idle.append((s1 - e0, e0))
    idle.sort(reverse=True)

    def around(t: float) -> tuple[str, str]:
        before = max((x for x in gpu if x[1] <= t + 1e-3), key=lambda x: x[1], default=None)
        after = min((x for x in gpu if x[0] >= t), key=lambda x: x[0], default=None)
        return (before[2].get("name", "?")[:90] if before else "-", after[2].get("name", "?")[:90] if after else "-")

    kernels: dict[str, list[float]] = defaultdict(list)
    for _s, _t, e in gpu:
        kernels[e.get("name", "?")].append(float(e["dur"]))
    kernel_rows = sorted(((sum(d), len(d), name) for name, d in kernels.items()), reverse=True)
    annotations: dict[str, list[float]] = defaultdict(list)
    runtime: dict[str, list[float]] = defaultdict(list)
    for e in events:
        ts = float(e["ts"])
        if not lo <= ts < hi:
            continue
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith("gpu_model_runner:"):
            annotations[name].append(float(e["dur"]))
        elif e.get("cat") == "user_annotation" and WORKER_STEP.match(name):
            annotations["worker: execute_model"].append(float(e["dur"]))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and name in RUNTIME_CALLS:
            runtime[name].append(float(e["dur"]))
    # the last prefill step before the decode steps: its host time (to the next step's start) and the kernels
    # that started while it ran on the host
    prefill = None
    before = [i for i, (t, kind, _) in enumerate(cut) if kind == "prefill" and t < lo]
    if before and before[-1] + 1 < len(cut):
        p0, p1 = cut[before[-1]][0], cut[before[-1] + 1][0]
        first = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e) for e in events
                       if e.get("cat") in GPU_CATS and p0 <= float(e["ts"]) < p1)
        first_kernels: dict[str, float] = defaultdict(float)
        for s0, t0, e in first:
            first_kernels[e.get("name", "?")] += t0 - s0
        prefill = {"step": cut[before[-1]][2], "host_us": round(p1 - p0, 2),
                   "gpu_busy_us": round(sum(t - s for s, t in _union([(s, t) for s, t, _ in first])), 2),
                   "kernels": [{"name": name[:120], "us": round(us, 2)} for us, name in
                               sorted(((us, name) for name, us in first_kernels.items()), reverse=True)[:12]]}
    return {
        "prefill": prefill,
        "steps": steps,
        "step_us": _spread(periods),
        "gpu_busy_us_per_step": round(busy_us / steps, 2),
        "gpu_idle_us_per_step": round((hi - lo - busy_us) / steps, 2),
        "gpu_busy_share": round(busy_us / (hi - lo), 4),
        "longest_idle": [{"us": round(g, 2), "after": around(t)[0], "before": around(t)[1]} for g, t in idle[:gaps]],
        "host_us_per_step": {k: _spread(v) for k, v in sorted(annotations.items())},
        "runtime_per_step": {k: {"calls": round(len(v) / steps, 2), "us": round(sum(v) / steps, 2)}
                             for k, v in sorted(runtime.items())},
        "kernels": [{"name": name[:120], "us_per_step": round(total / steps, 2), "per_step": round(n / steps, 2)}
                    for total, n, name in kernel_rows[:top]],
        "kernel_count_per_step": round(sum(len(d) for d in kernels.values()) / steps, 2),
    }


def markdown(summaries: dict[str, dict]) -> str:
    """The summaries side by side (steps, GPU busy and idle, host annotations, runtime calls), then each one's
    kernels and idle gaps."""
    names = list(summaries)
    head = "| | " + " | ".join(names) + " |"
    rule = "|---|" + "---|" * len(names)
    rows = [head, rule]

    def row(label: str, get) -> None:
        rows.append(f"| {label} | " + " | ".join(str(get(summaries[n])) for n in names) + " |")

    row("decode steps profiled", lambda s: s["steps"])
    row("step us, median [min-max]", lambda s: f"{s['step_us']['median']} [{s['step_us']['min']}-"
                                                f"{s['step_us']['max']}]")
    row("GPU busy us / step", lambda s: s["gpu_busy_us_per_step"])
    row("GPU idle us / step", lambda s: s["gpu_idle_us_per_step"])
    row("kernels / step", lambda s: s["kernel_count_per_step"])
    row("prefill step: host us / GPU busy us", lambda s: f"{s['prefill']['host_us']} / {s['prefill']['gpu_busy_us']}"
        if s["prefill"] else "-")
    for key in sorted({k for s in summaries.values() for k in s["host_us_per_step"]}):
        row(f"host: {key} (median us)", lambda s, k=key: s["host_us_per_step"].get(k, {}).get("median", "-"))
    for key in sorted({k for s in summaries.values() for k in s["runtime_per_step"]}):
        row(f"{key}: calls / us per step", lambda s, k=key: (lambda r: f"{r['calls']} / {r['us']}" if r else "-")(
            s["runtime_per_step"].get(k)))
    out = ["\n".join(rows)]
    for n in names:
        s = summaries[n]
        lines = [f"\n{n}: kernels by time per step (us, launches per step)"]
        lines += [f"  {k['us_per_step']:9.2f}  {k['per_step']:6.2f}  {k['name']}" for k in s["kernels"]]
        if s["prefill"]:
            lines.append(f"{n}: the prefill step's kernels ({s['prefill']['step']}; started while it ran on the "
                         "host), us")
            lines += [f"  {k['us']:9.2f}  {k['name']}" for k in s["prefill"]["kernels"]]
        lines.append(f"{n}: longest GPU idle gaps (us; the kernel before, the kernel after)")
        lines += [f"  {g['us']:9.2f}  {g['after']}  ->  {g['before']}" for g in s["longest_idle"]]
        out.append("\n".join(lines))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="NAME=PATH of a Chrome trace (.json or .json.gz)")
    p.add_argument("--json", help="write the summaries here as JSON")
    a = p.parse_args(argv)
    summaries = {}
    for item in a.traces:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"{item!r}: expected NAME=PATH (e.g. uva=/tmp/vllm_decode/profile/uva/trace.json.gz)")
        try:
            summaries[name] = summarize(load(path))
        except TraceError as e:
            print(f"trace_summary: {name}: {e}", file=sys.stderr)
            return 1
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summaries, f, indent=1)
    print(markdown(summaries), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
