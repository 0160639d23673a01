"""The vLLM engine scripts' own logic (``perf/vllm_carry/``: run on the GPU machine with vLLM carried there), on
a CPU: the decode benchmark's model plan, figures and refusals, the engine check's comparison of two engines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

CARRY = Path(__file__).resolve().parents[1] / "perf" / "vllm_carry"
if str(CARRY) not in sys.path:
    sys.path.insert(0, str(CARRY))

import decode_bench as db  # noqa: E402
import engine_check as ec  # noqa: E402
import trace_summary as ts  # noqa: E402

GIB = 1 << 30


# ------------------------------------------------------------------ decode_bench: the model
def test_the_planned_model_keeps_the_served_widths_and_fits_the_hbm_baseline():
    plan = db.plan_model(24.0, "fit", 512)
    assert plan["layers"] % db.PERIOD == 0 and plan["layers"] >= db.PERIOD
    assert plan["hbm_total_gib_about"] <= db.GPU_GIB - db.RESERVE_GIB  # weights + table + KV cache
    more = db.plan_model(24.0, plan["layers"] + db.PERIOD, 512)  # one more period would not fit
    assert (more["weights_bytes_about"] + more["table_bytes_about"] + db.KV_CACHE_BYTES) / GIB > \
        db.GPU_GIB - db.RESERVE_GIB
    assert plan["table_bytes_about"] >= 24 * GIB  # at least the table asked for, in bf16
    rows = plan["ngram_vocab_size_base"] * db.heads()
    assert rows * 160 * 2 < 24 * GIB + 16 * 160 * 2  # ... by less than a row a head
    cfg = db.model_config(plan)
    assert cfg["hidden_size"] == 2560 and cfg["num_experts"] == 512 and cfg["ple_embed_dim"] == 16 * 160
    assert cfg["layer_types"][:4] == ["linear_attention"] * 3 + ["indexed_attention"]
    assert cfg["ple_layer_ids"] == [1] and cfg["num_hidden_layers"] == plan["layers"]
    assert db.plan_model(24.0, "fit", 64)["layers"] > plan["layers"]  # fewer experts: more layers fit
    with pytest.raises(ValueError, match="multiple of 4"):
        db.plan_model(24.0, 6, 512)
    later = db.plan_model(24.0, "fit", 512, ple_layer=5)  # a layer for vLLM's host path to hide its gather behind
    assert db.model_config(later)["ple_layer_ids"] == [5] and later["layers"] == plan["layers"]
    assert db.model_config(later)["layer_types"][4] == "linear_attention"


@pytest.mark.parametrize("gpu_gib", [79.2, 93.1, 139.8])  # H100 80 GB, H100 NVL, H200 as CUDA reports them
def test_fit_takes_the_layers_the_gpu_at_hand_holds(gpu_gib):
    plan = db.plan_model(24.0, "fit", 512, gpu_gib=gpu_gib)
    assert plan["gpu_gib"] == gpu_gib and plan["layers"] % db.PERIOD == 0
    assert plan["hbm_total_gib_about"] <= gpu_gib - db.RESERVE_GIB
    more = db.plan_model(24.0, plan["layers"] + db.PERIOD, 512, gpu_gib=gpu_gib)
    assert (more["weights_bytes_about"] + more["table_bytes_about"] + db.KV_CACHE_BYTES) / GIB > \
        gpu_gib - db.RESERVE_GIB
    assert plan["layers"] < db.plan_model(24.0, "fit", 512)["layers"] or gpu_gib == db.GPU_GIB


def test_a_result_measured_on_another_model_is_measured_again(tmp_path):
    spec = {"config": "uva", "kwargs": {}, "batches": [8], "model": db.plan_model(24.0, 8, 512)}
    saved = tmp_path / "uva.spec.json"
    saved.write_text(json.dumps({**spec, "model": db.plan_model(24.0, 8, 512, ple_layer=5)}))
    assert db.spec_changes(str(saved), spec) == ["model"]


def test_the_model_config_is_written_by_transformers():
    pytest.importorskip("transformers")
    from transformers import Qwen4ExpTextConfig

    plan = db.plan_model(24.0, 8, 512)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        db.write_model(d, plan)
        saved = json.load(open(Path(d) / "config.json"))
        cfg = Qwen4ExpTextConfig.from_pretrained(d)
    assert saved["architectures"] == ["Qwen4ExpForCausalLM"] and cfg.hidden_size == 2560
    assert cfg.num_hidden_layers == 8 and cfg.ngram_vocab_size_base == plan["ngram_vocab_size_base"]
    assert saved.get("indexer_n_heads") is None  # vLLM builds plain attention without the QSA indexer


def test_each_configuration_is_the_engine_it_names(tmp_path):
    a = SimpleNamespace(batches=[1, 8, 32, 64], engine_batches=[], prompt=512, decode=256, profile=0, work="/w")
    kw, plugin = db.engine_kwargs(a, "hbm", "/m", True)
    assert not plugin and kw["engram_config"] == {"cpu_offload": False} and "uvaple" not in kw["additional_config"]
    kw, plugin = db.engine_kwargs(a, "host", "/m", True)
    assert not plugin and "engram_config" not in kw  # vLLM's default: its pinned host path
    kw, plugin = db.engine_kwargs(a, "uva_fp8row", "/m", False)
    assert plugin and kw["additional_config"]["uvaple"]["quantize"] == "fp8_row"
    assert kw["additional_config"]["uvaple"]["shared"] is False
    for c in db.CONFIGS:
        kw, _ = db.engine_kwargs(a, c, "/m", True)
        assert kw["cudagraph_capture_sizes"] == [1, 8, 32, 64] and kw["max_num_batched_tokens"] == 64 * 512
        assert kw["kv_cache_memory_bytes"] == db.KV_CACHE_BYTES and kw["enable_prefix_caching"] is False
        assert kw["load_format"] == "dummy" and "enforce_eager" not in kw  # vLLM's default graph mode
        assert "profiler_config" not in kw
    # batch 1 timed alone in the engine of the table, profiled: the same engine, the worker's profiler configured
    one = SimpleNamespace(batches=[1], engine_batches=[1, 8, 32, 64], prompt=512, decode=256, profile=1, work="/w")
    kw, _ = db.engine_kwargs(one, "uva", "/m", True)
    assert kw["cudagraph_capture_sizes"] == [1, 8, 32, 64] and kw["max_num_seqs"] == 64
    assert kw["profiler_config"]["profiler"] == "torch" and kw["profiler_config"]["torch_profiler_dir"] == \
        db.profile_dir("/w", "uva")
    # the timed runs of a profiled engine are a plain engine's: no profiling scopes in its environment
    assert not [k for k in db.child_env(True, str(tmp_path)) if "PROFIL" in k]


@pytest.mark.parametrize("argv,match", [
    (["--configs", "hbm,gpu"], "--configs: \\['gpu'\\]"),
    (["--batches", "1,x"], "--batches, --engine-batches: expected comma-separated integers, got .1,x."),
    (["--batches", "0"], "--batches: positive"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--decode", "1"], "--decode must be at least 2"),
    (["--layers", "6"], "--layers 6: a multiple of 4"),
    (["--ple-layer", "4"], "--ple-layer 4: a gated-delta-net layer of the 20, 1-based \\(not a multiple of 4"),
    (["--ple-layer", "0"], "--ple-layer 0: a gated-delta-net layer"),
    (["--layers", "8", "--ple-layer", "9"], "--ple-layer 9: a gated-delta-net layer of the 8"),
    (["--table-gib", "-1"], "--table-gib must be in"),
    (["--batches", "64", "--engine-batches", "1,8"], "--engine-batches \\[1, 8\\]: the engine must hold"),
    (["--batches", "1,8", "--profile", "9"], "--profile 9: a batch from 1 to 8"),
    (["--profile", "1", "--profile-tokens", "4"], "--profile-tokens at least 8"),
])
def test_bad_arguments_are_named(argv, match):
    r = subprocess.run([sys.executable, str(CARRY / "decode_bench.py"), "--plan", *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and pytest.importorskip("re").search(match, r.stderr), r.stderr


def test_the_plan_runs_anywhere_and_the_bench_refuses_a_machine_without_cuda(tmp_path):
    r = subprocess.run([sys.executable, str(CARRY / "decode_bench.py"), "--plan", "--configs", "hbm,uva"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert set(plan["engines"]) == {"hbm", "uva"} and plan["plan"]["layers"] % 4 == 0
    import torch

    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(CARRY / "decode_bench.py"), "--out", str(tmp_path / "o"),
                            "--work", str(tmp_path / "w")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "no CUDA GPU here" in r.stderr and "--plan" in r.stderr
        assert not (tmp_path / "w").exists()  # refused before any work


def test_a_configuration_measured_before_is_kept_only_for_the_same_measurement(tmp_path):
    """A result in --work is kept when the call asks for the same measurement (the segment's name, which holds the
    call's pid, and the call's text aside); other batches, repetitions or engine arguments measure it again."""
    def spec(pid=1, **over):
        kw = {"model": "/w/model", "additional_config": {"uvaple": {"placement": "uva", "segment": f"bench-uva-{pid}"}}}
        s = {"config": "uva", "kwargs": kw, "call": f"vllm.LLM(... {pid})", "batches": (1, 8), "reps": 5, "cpus": None}
        s.update(over)
        return s

    path = tmp_path / "uva.spec.json"
    assert db.spec_changes(str(path), spec()) == sorted(spec())  # none saved: everything is new
    path.write_text(json.dumps(spec(pid=1)))
    assert db.spec_changes(str(path), spec(pid=2)) == []
    assert db.spec_changes(str(path), spec(pid=2, batches=[1, 8, 64], reps=7)) == ["batches", "reps"]
    other = spec(pid=2)
    other["kwargs"]["additional_config"]["uvaple"]["placement"] = "device"
    assert db.spec_changes(str(path), other) == ["kwargs"]
    path.write_text("{not json")
    assert db.spec_changes(str(path), spec()) == sorted(spec())


# ------------------------------------------------------------------ decode_bench: the figures
def _outs(first: list[float], last: list[float], n: int):
    return [SimpleNamespace(metrics=SimpleNamespace(first_token_ts=f, last_token_ts=t),
                            outputs=[SimpleNamespace(token_ids=list(range(n)))])
            for f, t in zip(first, last, strict=True)]


def test_the_decode_step_comes_from_the_engines_timestamps():
    assert db.decode_step_ms(_outs([1.0, 1.0, 1.0], [1.51, 1.5, 1.52], 51), 51) == pytest.approx(10.2)
    assert db.decode_step_ms(_outs([1.0], [2.0], 50), 51) is None  # a request stopped early: no figure
    assert db.decode_step_ms([SimpleNamespace(metrics=None, outputs=[SimpleNamespace(token_ids=[0] * 5)])], 5) is None


def _result(step_ms: list[float], ttft_s: list[float], batch: str = "8") -> dict:
    return {"ok": True, "batches": {batch: {"step_ms": step_ms, "ttft_s": ttft_s, "gpu_util": [99.0, None, 98.0]}}}


def test_figures_are_medians_with_their_spread_and_ratios_of_medians():
    res = {"hbm": _result([10.0, 11.0, 10.5], [0.100, 0.102, 0.101]),
           "host": _result([12.0, 12.5, 12.2], [0.110, 0.111, 0.112]),
           "uva": _result([10.2, 10.4, 10.9], [0.1015, 0.1010, 0.1030])}
    t = db.figures(res)
    uva = t["uva"]["8"]
    assert uva["step_ms"] == {"median": 10.4, "min": 10.2, "max": 10.9, "n": 3}
    assert uva["tokens_per_s"]["median"] == pytest.approx(8e3 / 10.4, rel=1e-4)
    assert uva["x_hbm_tokens_per_s"] == pytest.approx(10.5 / 10.4, rel=1e-3)
    assert uva["x_host_tokens_per_s"] == pytest.approx(12.2 / 10.4, rel=1e-3)
    assert uva["x_hbm_ttft"] == pytest.approx(101.5 / 101.0, rel=1e-3)
    assert "x_hbm_tokens_per_s" not in t["hbm"]["8"]
    assert uva["gpu_util_pct"]["median"] == 98.5
    res["uva"]["start_phases"] = {"load_s": 117.2, "init_engine_s": 165.7}
    res["uva"]["segments_left"] = ["uvaple.bench-uva-7.model.layers.0.ple.r0of1"]
    md = db.markdown(t, res, db.plan_model(24.0, 8, 512), SimpleNamespace(prompt=512, decode=256, reps=3))
    assert "| uva | 8 | 769.2 [733.9-784.3] |" in md
    assert "| uva | - | 117.2 | 165.7 |" in md and "| hbm | - | - | - |" in md
    uva_start = next(ln for ln in md.splitlines() if ln.startswith("| uva | - |"))
    hbm_start = next(ln for ln in md.splitlines() if ln.startswith("| hbm | - |"))
    assert uva_start.split(" | ")[-2] == "1" and hbm_start.split(" | ")[-2] == "0"  # segments left at its stop


def test_the_engine_starts_phases_come_from_vllms_log(tmp_path):
    log = tmp_path / "uva.log"
    log.write_text("\n".join([
        "INFO 12-04 17:53:34 [vllm.v1.worker.gpu.model_runner model_runner.py:428] Model loading took 80.3 GiB "
        "memory and 117.229971 seconds",
        "INFO 12-04 17:56:20 [vllm.v1.engine.core core.py:412] init engine (profile, create kv cache, warmup model) "
        "took 165.74 s",
        "INFO a second engine's line: init engine (profile) took 9.0 s"]))
    assert db.start_phases(str(log)) == {"load_s": 117.2, "init_engine_s": 165.7}
    assert db.start_phases(str(tmp_path / "absent.log")) == {}


def test_jit_lines_are_counted_inside_the_timed_runs_only(tmp_path):
    log = tmp_path / "c.log"
    log.write_text("\n".join([
        "WARNING triton jit during inference: warm-up (before the timed runs: not counted)",
        "=== uvaple-bench timed start batch 8",
        "INFO step",
        "WARNING Triton jit during inference: _gather_kernel (x)",
        "=== uvaple-bench timed end batch 8",
        "=== uvaple-bench timed start batch 64",
        "=== uvaple-bench timed end batch 64",
        "WARNING Triton jit during inference: after"]))
    got = db.jit_lines(str(log))
    assert list(got) == ["8", "64"] and len(got["8"]) == 1 and got["64"] == []


def test_jit_count_counts_the_monitors_lines_logged_so_far(tmp_path):
    log = tmp_path / "c.log"
    assert db.jit_count(str(log)) == 0 and db.jit_count(None) == 0  # no log yet, or none named
    log.write_text("INFO a\nWARNING Triton kernel JIT compilation during inference: k (x)\nINFO b\n")
    assert db.jit_count(str(log)) == 1
    with open(log, "a") as f:
        f.write("WARNING Triton kernel JIT compilation during inference: k (y)\n")
    assert db.jit_count(str(log)) == 2


def test_warm_up_repeats_a_shape_until_a_pass_compiles_nothing():
    compiles = [3, 2, 0, 5]  # what each pass would compile; the fourth is never run
    seen, runs = [0], []

    def one_pass():
        runs.append(len(runs))
        seen[0] += compiles[len(runs) - 1]

    assert db.warm_up(one_pass, lambda: seen[0], most=4) == 3 and len(runs) == 3


def test_warm_up_stops_at_its_most_passes_and_runs_once_when_nothing_compiles():
    runs = []
    assert db.warm_up(lambda: runs.append(1), lambda: len(runs), most=2) == 2 and len(runs) == 2
    runs.clear()
    assert db.warm_up(lambda: runs.append(1), lambda: 0, most=4) == 1 and len(runs) == 1


def test_a_saved_spec_that_differs_only_in_its_logs_path_is_the_same_measurement(tmp_path):
    spec = {"config": "uva", "call": "vllm.LLM(...)", "kwargs": {}, "batches": [8], "log": "/a/uva.log",
            "warmup_passes": 4}
    saved = tmp_path / "uva.spec.json"
    saved.write_text(json.dumps({**spec, "log": "/b/uva.log", "call": "other"}))
    assert db.spec_changes(str(saved), spec) == []
    saved.write_text(json.dumps({k: v for k, v in spec.items() if k != "warmup_passes"}))
    assert db.spec_changes(str(saved), spec) == ["warmup_passes"]


# ------------------------------------------------------------------ trace_summary: where a step's time goes
def _x(name, cat, ts, dur, **kw):
    return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, **kw)


def _trace(steps: int = 6, period: float = 100.0) -> list[dict]:
    """``steps`` decode steps of ``period`` us: kernel A (40 us) and B (20 us) 5 us apart, a copy on another stream
    inside A, one graph launch and a sample scope each; the GPU's side annotation carries the step's name too."""
    ev = [_x("PyTorch Profiler (0)", "Trace", 0, steps * period)]
    for i in range(steps):
        s = i * period
        ev += [_x(ts.STEP_MARK, "user_annotation", s, 30), _x(ts.STEP_MARK, "gpu_user_annotation", s + 5, 65),
               _x("gpu_model_runner: sample", "user_annotation", s + 40, 7),
               _x("cudaGraphLaunch", "cuda_runtime", s + 2, 10),
               _x("kernel_A", "kernel", s + 5, 40), _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", s + 10, 15),
               _x("kernel_B", "kernel", s + 50, 20)]
    return ev


def test_trace_summary_cuts_the_decode_steps_and_finds_the_gpus_idle_gaps():
    s = ts.summarize(_trace())
    # six marks: the first (prefill) and last (profiler stop) are dropped, four starts make three whole steps
    assert s["steps"] == 3 and s["step_us"] == {"median": 100.0, "min": 100.0, "max": 100.0, "n": 3}
    assert s["gpu_busy_us_per_step"] == 60.0  # A and B; the copy inside A counts once
    assert s["gpu_idle_us_per_step"] == 40.0 and s["gpu_busy_share"] == 0.6
    assert s["longest_idle"][0] == {"us": 35.0, "after": "kernel_B", "before": "kernel_A"}
    assert s["longest_idle"][-1]["us"] == 5.0 and s["longest_idle"][-1]["after"] == "kernel_A"
    assert s["host_us_per_step"]["gpu_model_runner: sample"]["median"] == 7.0
    assert s["runtime_per_step"]["cudaGraphLaunch"] == {"calls": 1.0, "us": 10.0}
    assert [k["name"] for k in s["kernels"]] == ["kernel_A", "kernel_B", "Memcpy HtoD (Pinned -> Device)"]
    assert s["kernels"][0] == {"name": "kernel_A", "us_per_step": 40.0, "per_step": 1.0}
    assert s["kernel_count_per_step"] == 3.0
    # the prefill: the first mark to the second, its kernels (A, B and the copy inside A: busy 60 of 100 us)
    assert s["prefill"] == {"step": ts.STEP_MARK, "host_us": 100.0, "gpu_busy_us": 60.0, "kernels": [
        {"name": "kernel_A", "us": 40.0}, {"name": "kernel_B", "us": 20.0},
        {"name": "Memcpy HtoD (Pinned -> Device)", "us": 15.0}]}
    slow = [dict(e, dur=e["dur"] * 2) if e["name"] == "kernel_B" else e for e in _trace()]
    table = ts.markdown({"fast": s, "slow": ts.summarize(slow)})
    assert "| GPU busy us / step | 60.0 | 80.0 |" in table and "| GPU idle us / step | 40.0 | 20.0 |" in table
    assert "| cudaGraphLaunch: calls / us per step | 1.0 / 10.0 | 1.0 / 10.0 |" in table
    assert "| prefill step: host us / GPU busy us | 100.0 / 60.0 | 100.0 / 80.0 |" in table
    assert "fast: the prefill step's kernels" in table


def _worker_trace(plan: str, period: float = 100.0) -> list[dict]:
    """Steps as vLLM's worker annotates them, one a character of ``plan``: ``p`` a prefill of 512 tokens, ``d`` a
    decode step (kernel_A 40 us); a decode step lasts ``period`` us, a prefill twice that (kernel_P 150 us). The
    GPU's side of each annotation has the same name and must not count as a step."""
    ev, t = [], 0.0
    for c in plan:
        name = "execute_context_1(512)_generation_0(0)" if c == "p" else "execute_context_0(0)_generation_1(1)"
        length = 2 * period if c == "p" else period
        ev += [_x(name, "user_annotation", t, 20), _x(name, "gpu_user_annotation", t + 5, length - 10),
               _x("kernel_P" if c == "p" else "kernel_A", "kernel", t + 5, 150 if c == "p" else 40),
               _x("cudaGraphLaunch", "cuda_runtime", t + 2, 10), _x("aten::mm", "cpu_op", t + 1, 3)]
        t += length
    return ev


def test_trace_summary_cuts_at_the_workers_step_annotations_and_tells_prefill_from_decode():
    """vLLM 0.33's V2 model runner records no 'gpu_model_runner: forward'; its worker names every step after the
    requests in it. The decode steps are the longest run of decode steps in a row (a later prefill, a request
    arriving mid-profile, does not fall inside them), less the last; the prefill is the one just before them."""
    s = ts.summarize(_worker_trace("pdddddd" + "p" + "ddd"))
    assert s["steps"] == 4 and s["step_us"]["median"] == 100.0  # six decode marks: five starts, four whole steps
    assert s["gpu_busy_us_per_step"] == 40.0 and [k["name"] for k in s["kernels"]] == ["kernel_A"]
    assert s["host_us_per_step"]["worker: execute_model"]["median"] == 20.0
    assert s["runtime_per_step"]["cudaGraphLaunch"] == {"calls": 1.0, "us": 10.0}
    assert s["prefill"]["step"] == "execute_context_1(512)_generation_0(0)"
    assert s["prefill"]["host_us"] == 200.0 and s["prefill"]["kernels"] == [{"name": "kernel_P", "us": 150.0}]
    # the detailed annotation (profiler_config detailed_trace_annotation) is a step too
    detailed = [dict(e, name=e["name"].replace("execute_", "execute_513_").replace("(512)", "(sq512sk512sqsq1sqsk1)"))
                for e in _worker_trace("pddd")]
    d = ts.summarize(detailed)
    assert d["steps"] == 1 and d["prefill"]["step"].startswith("execute_513_context_1(sq512")
    # decode steps alone (the profile started after the prefill): no prefill row, the table says "-"
    alone = ts.summarize(_worker_trace("dddd"))
    assert alone["prefill"] is None and alone["steps"] == 2
    table = ts.markdown({"a": alone, "b": s})
    assert "| prefill step: host us / GPU busy us | - | 200.0 / 150.0 |" in table
    assert "| host: worker: execute_model (median us) | 20.0 | 20.0 |" in table
    with pytest.raises(ts.TraceError, match="no whole decode step annotated \\(7 steps in all\\)"):
        ts.summarize(_worker_trace("pddpddp"))  # never three decode steps in a row


def test_a_trimmed_trace_summarises_as_the_whole_one(tmp_path):
    """trim keeps what summarize reads and nothing else (the host's operators go): the trace a benchmark brings
    back when the whole one is too large gives the same summary."""
    ev = _worker_trace("pdddddp")
    kept = ts.trim(ev)
    assert len(kept) < len(ev) and not [e for e in kept if e["cat"] == "cpu_op"]
    path = tmp_path / "t.json.gz"
    assert ts.save(kept, str(path)) == path.stat().st_size > 0
    assert ts.summarize(ts.load(str(path))) == ts.summarize(ev)


def test_trace_summary_reads_a_torch_profiler_trace_and_refuses_what_it_cannot_summarise(tmp_path):
    import gzip

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(6):
            with record_function(ts.STEP_MARK):
                torch.randn(64, 64) @ torch.randn(64, 64)
    path = tmp_path / "worker.pt.trace.json"
    prof.export_chrome_trace(str(path))
    gz = tmp_path / "worker.pt.trace.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    s = ts.summarize(ts.load(str(gz)))
    assert s["steps"] == 3 and s["gpu_busy_us_per_step"] == 0 and s["kernels"] == []  # a CPU trace: no kernels
    with pytest.raises(ts.TraceError, match="no whole decode step.*3 steps in all.*VLLM_CUSTOM_SCOPES_FOR_PROFILING"):
        ts.summarize(_trace(steps=3))
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(ts.TraceError, match="not a readable Chrome trace"):
        ts.load(str(bad))
    r = subprocess.run([sys.executable, str(CARRY / "trace_summary.py"), f"cpu={gz}", f"bad={bad}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "bad: " in r.stderr and "not a readable Chrome trace" in r.stderr
    r = subprocess.run([sys.executable, str(CARRY / "trace_summary.py"), str(gz)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "expected NAME=PATH" in r.stderr
    r = subprocess.run([sys.executable, str(CARRY / "trace_summary.py"), f"cpu={gz}", "--json",
                        str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "| decode steps profiled | 3 |" in r.stdout
    assert json.loads((tmp_path / "s.json").read_text())["cpu"]["steps"] == 3


def test_the_bench_summarises_the_newest_trace_and_keeps_small_ones(tmp_path, monkeypatch):
    import gzip

    trace_dir, out = tmp_path / "profile" / "uva", tmp_path / "out"
    trace_dir.mkdir(parents=True)
    out.mkdir()
    assert "no trace in" in db.profile_summary(str(trace_dir), str(out), "uva")["error"]
    old = trace_dir / "w.1.pt.trace.json.gz"
    old.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace(steps=5)}).encode()))
    new = trace_dir / "w.2.pt.trace.json.gz"
    new.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace(steps=8)}).encode()))
    import os

    os.utime(old, (1, 1))
    (trace_dir / "w.profiler_out.txt").write_text("table")
    s = db.profile_summary(str(trace_dir), str(out), "uva")
    assert s["steps"] == 5 and s["trace"] == str(new)  # eight marks: six starts, five steps
    assert ts.load(str(out / "profile_uva.json.gz")) == ts.trim(ts.load(str(new)))  # what the summary reads
    assert (out / "profile_uva_table.txt").read_text() == "table"
    # a trace the summary cannot cut still comes back (cut to what it reads), with vLLM's table
    new.write_bytes(gzip.compress(json.dumps({"traceEvents": _trace(steps=3)}).encode()))
    (out / "profile_uva_table.txt").unlink()
    failed = db.profile_summary(str(trace_dir), str(out), "uva")
    assert "no whole decode step" in failed["error"] and failed["trace"] == str(new)
    assert len(ts.load(str(out / "profile_uva.json.gz"))) == len(ts.trim(_trace(steps=3)))
    assert (out / "profile_uva_table.txt").read_text() == "table"
    # one larger than the bound stays on the machine
    monkeypatch.setattr(db, "TRACE_KEEP_BYTES", 10)
    assert db.profile_summary(str(trace_dir), str(out), "uva")["error"]
    assert not (out / "profile_uva.json.gz").exists()
    text = db.profiles_markdown({"uva": {"profiled": {"batch": 1}, "profile": s}, "hbm": {"ok": True}})
    assert "Profiled decode steps at batch 1" in text and "| | uva |" in text


# ------------------------------------------------------------------ engine_check: comparing engines
def test_a_graph_runs_compiled_graphs_are_kept_beside_its_result(tmp_path):
    """Each FX graph vLLM's compilation wrote under the run's cache root, copied out under a name that says which
    compilation, rank and piece it is (two engines' graphs compared where their bits differ); none: nothing."""
    root = tmp_path / "cache"
    for h, prefix in (("ab12", "backbone"), ("ab12", "eagle_head"), ("cd34", "backbone")):
        d = root / "torch_compile_cache" / h / "rank_0_0" / prefix
        d.mkdir(parents=True)
        (d / "computation_graph.py").write_text(f"# {h} {prefix}\n")
        (d / "cache_key_factors.json").write_text("{}")
    kept = ec.keep_graphs(str(root), str(tmp_path / "out"))
    assert kept == ["ab12.rank_0_0.backbone.py", "ab12.rank_0_0.eagle_head.py", "cd34.rank_0_0.backbone.py"]
    assert (tmp_path / "out" / "cd34.rank_0_0.backbone.py").read_text() == "# cd34 backbone\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == kept
    assert ec.keep_graphs(str(tmp_path / "none"), str(tmp_path / "out2")) == []
    assert not (tmp_path / "out2").exists()


def _run(tokens, top2):
    return {"ok": True, "tokens": tokens, "top2": top2}


def test_two_engines_are_identical_only_with_every_logprob_equal():
    toks = [[5, 6, 7], [8, 9]]
    lp = [[[-0.1, -2.5], [-0.2, -3.0], [-0.3, -1.0]], [[-0.5, -0.7], [-0.9, -1.9]]]
    same = ec._diff(_run(toks, lp), _run([list(t) for t in toks], json.loads(json.dumps(lp))))
    assert same["identical"] and same["logprobs_compared"] == 10 and same["logprobs_differing"] == 0
    lp2 = json.loads(json.dumps(lp))
    lp2[1][0][1] = -0.70001
    d = ec._diff(_run(toks, lp), _run(toks, lp2))
    assert d["tokens_identical"] and not d["identical"] and d["logprobs_differing"] == 1
    assert d["max_logprob_difference"] == pytest.approx(1e-5)
    other = ec._diff(_run(toks, lp), _run([[5, 6, 1], [8, 9]], lp))
    assert not other["tokens_identical"] and other["first_difference"]["prompt"] == 0
    assert other["first_difference"]["step"] == 2 and other["first_difference"]["reference_top2_margin"] == 0.7
    assert ec._verdict("uva", dict(d, ok=True, reference="hbm")) == "same tokens, 1 of 10 logprobs differ"
    assert ec._verdict("copy", {"ok": False, "expected_error": "x", "refused_as_expected": True}) == \
        "refused as expected"


def test_the_comparison_names_an_engine_whose_tokens_agree_but_whose_logprobs_do_not(tmp_path, capsys):
    toks = [[5, 6, 7], [8, 9]]
    lp = [[[-0.1, -2.5], [-0.2, -3.0], [-0.3, -1.0]], [[-0.5, -0.7], [-0.9, -1.9]]]
    moved = json.loads(json.dumps(lp))
    moved[0][1][0] = -0.2001
    a = SimpleNamespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"), deadline_s=60.0, force=False)
    check = ec.Check(a)
    runs = {"hbm": _run(toks, lp), "uva": _run(toks, moved), "device": _run([[5, 6, 1], [8, 9]], lp)}
    check.compare("qwen4exp_bf16", "graph", "default", runs)
    rows = check.res["tokens"]["qwen4exp_bf16"]["graph"]["configs"]
    assert rows["uva"]["tokens_identical"] and not rows["uva"]["identical"] and "first_difference" not in rows["uva"]
    assert rows["device"]["first_difference"]["step"] == 2
    out = capsys.readouterr().out
    assert "uva against hbm: same tokens, 1 of 10 logprobs differ; first differing token: tokens identical" in out
    assert "device against hbm: DIFFERENT tokens; first differing token: {'prompt': 0, 'step': 2" in out


def test_a_refusal_counts_where_the_engine_core_printed_it_in_its_own_process():
    expect = ec.CONFIGS["copy"]["expect"]["graph"]
    named = (f"uvaple.integration.models.vllm.config.PluginConfigError: {expect} (each copy-placement call waits "
             "on the host for its ids): start the engine with enforce_eager=True")
    core = {"ok": False, "error": "RuntimeError: Engine core initialization failed. See root cause above.",
            "log_tail": "  File \"vllm/v1/engine/core.py\", line 1588, in run_engine_core\n    raise e",
            "uvaple_lines": ["INFO non-default args: {'uvaple': {'placement': 'copy'}}", named]}
    assert ec.refused(core, expect)
    assert ec.refused({"ok": False, "error": f"PluginConfigError: {expect} (...)"}, expect)  # in this process
    assert not ec.refused(dict(core, uvaple_lines=core["uvaple_lines"][:1]), expect)  # another failure
    assert not ec.refused(dict(core, ok=True), expect)  # an engine that ran was not refused


def test_a_group_needs_what_the_longest_group_of_its_mode_took():
    assert ec.group_need("graph", None) == ec.GROUP_S["graph"]  # nothing run yet in this WORK
    assert ec.group_need("graph", 100.0) == pytest.approx(140.0)  # a warm cache's group, with a margin
    assert ec.group_need("eager", 190.0) > 190.0


def test_every_configuration_has_a_reference_that_runs_where_it_runs():
    for model in ec.MODELS:
        for mode in ec.MODES:
            for c in ec.CONFIGS:
                if ec.applies(c, model, mode) and "expect" not in ec.CONFIGS[c]:
                    assert ec.applies(ec.reference(c), model, mode), (c, model, mode)
    assert not ec.applies("host", "gemma3n", "eager")  # vLLM has no host path for Gemma 3n
    assert not ec.applies("copy_again", "qwen4exp_bf16", "graph")
    assert ec.CONFIGS["copy"]["expect"]["graph"] in "placement 'copy' cannot run inside vLLM's CUDA graphs (each"


def test_the_gemma3n_vocabulary_holds_every_key_vllms_processing_reads(tmp_path):
    pytest.importorskip("transformers")
    import checkpoints as ck
    from transformers import AutoTokenizer

    ck.save_gemma3n_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))  # as vLLM loads it
    vocab = tok.get_vocab()
    keys = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]  # vLLM 0.33, gemma3n_mm.py: vocab["\n"] .. vocab["\n\n\n\n"]
    assert set(keys) <= set(ck.GEMMA3N_VOCAB_LOOKUPS)
    ids = [vocab[k] for k in keys]
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids
    media = [tok.convert_tokens_to_ids(t) for t in ck.GEMMA3N_MEDIA_TOKENS.values()]
    assert len(set(media)) == 6 and tok.unk_token_id not in media and not set(media) & set(ids)
    assert len(vocab) == ck.VOCAB
    words = tok(ck.prompts()[0], add_special_tokens=False)["input_ids"]
    assert words and not set(words) & set(ids + media)  # the prompts are words, never a special


def test_runs_of_an_earlier_lease_count_only_for_the_same_checkpoint_bytes(tmp_path):
    import checkpoints as ck

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\x01\x02" * 1000)
    (ckpt / "config.json").write_text("{}")
    first = ck.digest(str(ckpt))
    (ckpt / ".done").write_text("{}")  # the build's record is not the checkpoint
    assert ck.digest(str(ckpt)) == first
    (ckpt / "model.safetensors").write_bytes(b"\x01\x03" * 1000)
    assert ck.digest(str(ckpt)) != first
    src = tmp_path / "runs"
    src.mkdir()

    def result(key, dig, gpu="H100", **kw):
        model = key.split(".")[0]
        spec = {"key": key, "model": model, "ckpt_digest": dig}
        if gpu is not None:
            spec["gpu"] = gpu
        (src / f"{key}.json").write_text(json.dumps(dict({"spec": spec, "ok": True, "tokens": [[1]]}, **kw)))

    result("qwen4exp_bf16.eager.hbm", "same")
    result("qwen4exp_bf16.eager.uva", "other")  # another checkpoint: run again
    result("qwen4exp_bf16.eager.copy", "same", ok=False, stage="timeout")  # stopped at its limit: run again
    result("qwen4exp_bf16.eager.device", "same", ok=False, stage="LLM()", error="E")  # a failure is a result
    result("qwen4exp_bf16.graph-default.hbm", "same", gpu="H200")  # another GPU model: run again
    result("qwen4exp_bf16.graph-default.uva", "same", gpu=None)  # its call's GPU, from engine_check.json
    (src / "qwen4exp_bf16.eager.hbm.spec.json").write_text(json.dumps({"key": "qwen4exp_bf16.eager.hbm"}))
    (src / "engine_check.json").write_text(json.dumps({"runs": {}}))  # runs/ beside it: not a run's result

    def resumed(call_gpu, env_gpu="H100"):
        (tmp_path / "engine_check.json").write_text(json.dumps({"env": {"gpu": call_gpu}}))
        work = tmp_path / f"work-{call_gpu}-{env_gpu}"
        a = SimpleNamespace(out=str(tmp_path / "out"), work=str(work), deadline_s=60.0, force=False)
        check = ec.Check(a)
        check.res["checkpoints"] = {"qwen4exp_bf16": {"digest": "same"}}
        check.res["env"] = {"gpu": env_gpu}
        check.resume(str(src))
        return check

    check = resumed("H100")
    assert check.done("qwen4exp_bf16.eager.hbm")["tokens"] == [[1]]
    assert check.done("qwen4exp_bf16.eager.device")["error"] == "E"
    assert check.done("qwen4exp_bf16.eager.uva") is None and check.done("qwen4exp_bf16.eager.copy") is None
    assert check.done("qwen4exp_bf16.graph-default.hbm") is None
    assert sorted(check.res["runs"]) == ["qwen4exp_bf16.eager.device", "qwen4exp_bf16.eager.hbm",
                                         "qwen4exp_bf16.graph-default.uva"]
    note = check.res["notes"][-1]
    assert "resumed 3 runs" in note and "qwen4exp_bf16.eager.uva" in note
    assert "1 run on another GPU than this call's H100: qwen4exp_bf16.graph-default.hbm" in note
    copied = check.done("qwen4exp_bf16.graph-default.uva")  # names its GPU now, wherever it is committed next
    assert copied["spec"]["gpu"] == "H100" and copied["resumed_from"] == str(src)
    check = resumed("H200")  # the unnamed run now belongs to an H200's call
    assert check.done("qwen4exp_bf16.graph-default.uva") is None and check.done("qwen4exp_bf16.eager.hbm")
    assert "2 run on another GPU" in check.res["notes"][-1]
    check = resumed("H100", env_gpu=None)  # this call's GPU unknown (env failed): nothing is taken
    assert check.res.get("runs", {}) == {} and "resumed 0 runs" in check.res["notes"][-1]
    r = subprocess.run([sys.executable, str(CARRY / "engine_check.py"), "--resume", str(tmp_path / "nope"),
                        "--work", str(tmp_path / "w2")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--resume" in r.stderr and "not a folder" in r.stderr


def test_the_cores_an_engine_runs_on_are_read_and_checked(monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert db.parse_cpus("") == []
    assert db.parse_cpus("0-3, 8,2") == [0, 1, 2, 3, 8]
    for bad, says in (("7-5", "from a core to a later one"), ("a-b", "not a core"), ("-1", "not a core"),
                      ("12-17", "cores [16, 17] are not among")):
        with pytest.raises(ValueError, match=re.escape(says)):
            db.parse_cpus(bad)
    with pytest.raises(SystemExit):
        db.main(["--plan", "--cpus", "7-5"])
    assert "--cpus '7-5': '7-5': a range runs from a core to a later one" in capsys.readouterr().err


# ------------------------------------------------------------------ engine_check: stopping a server
def _server(code: str) -> subprocess.Popen:
    """A stand-in server started as engine_check starts ``vllm serve``: ``code`` runs, then it prints ready and
    waits."""
    p = ec.start_server([sys.executable, "-c", code + "\nimport sys,time\nprint('ready', flush=True)\n"
                         "while True: time.sleep(0.05)"], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_server_started_where_ctrl_c_is_ignored_still_stops_at_ctrl_c():
    """A run started from a background job (or nohup) ignores SIGINT, and its children inherit that across exec:
    the server's SIGINT is set back to its default before its command runs."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        p = _server("")
    finally:
        signal.signal(signal.SIGINT, old)
    rec = ec._stop_server(p, sigint_wait_s=5)
    assert rec["by"] == "SIGINT" and rec["exit_status"] != 0


def test_a_server_is_stopped_as_ctrl_c_does_and_the_record_says_which_signal_did_it():
    p = _server("")  # Python's default: SIGINT raises KeyboardInterrupt, the process ends
    rec = ec._stop_server(p)
    assert rec["by"] == "SIGINT" and rec["exit_status"] != 0 and rec["group_killed_after"] is False
    assert p.poll() is not None
    p = _server("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)")
    rec = ec._stop_server(p, sigint_wait_s=3)  # deaf to Ctrl-C: SIGTERM after the wait
    assert rec["by"] == "SIGTERM" and rec["exit_status"] == -15 and rec["seconds"] >= 3
    rec = ec._stop_server(p)
    assert rec["by"] == "exited by itself" and rec["exit_status"] == -15 and rec["group_killed_after"] is False


def test_a_process_left_in_the_servers_group_is_killed_and_said():
    # The server spawns a child that ignores SIGINT (as an engine core busy in a CUDA call may not act on it).
    # The server is ready once its child deafened itself (else the SIGINT could find the child not yet deaf).
    p = _server("import subprocess,sys\n"
                "c = subprocess.Popen([sys.executable,'-c','import signal,time; signal.signal(signal.SIGINT, "
                "signal.SIG_IGN); print(1, flush=True); time.sleep(120)'], stdout=subprocess.PIPE)\n"
                "c.stdout.readline()")
    rec = ec._stop_server(p, group_wait_s=2)
    assert rec["by"] == "SIGINT" and rec["group_killed_after"] is True
    assert ec._group_gone(p.pid, 5.0)


def test_a_server_that_ended_by_itself_still_has_its_group_stopped():
    # the server exits at once (as one whose engine core failed), leaving a child that would hold the GPU
    code = ("import subprocess,sys\n"
            "c = subprocess.Popen([sys.executable,'-c','import time; print(1, flush=True); time.sleep(120)'], "
            "stdout=subprocess.PIPE)\n"
            "c.stdout.readline()\n"
            "sys.exit(3)")
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    p.wait(timeout=30)
    assert ec._group_alive(p.pid)  # its child runs on
    rec = ec._stop_server(p, group_wait_s=1)
    assert rec["by"] == "exited by itself" and rec["exit_status"] == 3 and rec["group_killed_after"] is True
    assert ec._group_gone(p.pid, 5.0)


def test_a_zombie_is_not_a_process_left_running():
    # a group whose other member has ended and is not reaped (its parent sleeps): only the parent runs
    p = _server("import os,sys\n"
                "if os.fork() == 0: os._exit(0)\n")
    try:
        import time

        for _ in range(50):  # the child ends just after the fork
            if ec._group_alive(p.pid) == [p.pid]:
                break
            time.sleep(0.1)
        assert ec._group_alive(p.pid) == [p.pid]
    finally:
        p.kill()
        p.wait()


# ------------------------------------------------------------------ build: parts that fit a call
def test_a_part_leaves_room_for_the_working_tree_to_grow_in_one_call():
    import build
    mib = build.MIB
    assert build.default_part_mib(19 * mib) == 36  # 64 - 1 - 19 - 8
    assert build.default_part_mib(1 * mib) == 54
    assert build.default_part_mib(60 * mib) == 8  # a tree too big for any part: parts of 8 MiB, and the warning
    assert build.default_part_mib(None) == 31  # the tree unknown (no git): 24 MiB assumed
    for tree in (5, 19, 40):
        assert tree + build.default_part_mib(tree * mib) + build.TREE_GROWTH_MIB <= 63


# ------------------------------------------------------------------ decode_bench: Gemma 3n E4B
def test_gemma3n_is_e4b_as_vllm_serves_it_with_its_own_configurations(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoProcessor, AutoTokenizer, Gemma3nConfig

    plan = db.plan_gemma3n()
    assert plan["table_bytes_about"] == 262144 * 35 * 256 * 2 and 8 < plan["weights_bytes_about"] / GIB < 10
    info = db.write_gemma3n(str(tmp_path / "m"))
    saved = json.load(open(tmp_path / "m" / "config.json"))
    cfg = Gemma3nConfig.from_pretrained(tmp_path / "m")
    # the multimodal class: vLLM 0.33's text-only Gemma3nForCausalLM never reads the per-layer table
    assert saved["architectures"] == ["Gemma3nForConditionalGeneration"] and info["path"] == str(tmp_path / "m")
    t = cfg.text_config
    assert (t.num_hidden_layers, t.vocab_size_per_layer_input, t.hidden_size_per_layer_input) == (35, 262144, 256)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tok) == t.vocab_size  # every id a prompt may hold is a token
    media = info["media_token_ids"]
    assert media["boi_token"] == cfg.boi_token_id and media["audio_token"] == cfg.audio_token_id
    assert max(media.values()) < db.PROMPT_ID_MIN  # no prompt id is a media token
    for s in ("\n", "\n\n", "\n\n\n", "\n\n\n\n"):  # what vLLM's Gemma 3n processing reads by key
        assert s in tok.get_vocab()
    AutoProcessor.from_pretrained(tmp_path / "m")  # the processor vLLM loads
    a = SimpleNamespace(batches=[1, 8], engine_batches=[], prompt=512, decode=256, profile=0, work="/w",
                        model="gemma3n")
    kw, plugin = db.engine_kwargs(a, "hbm", "/m", True)
    assert not plugin and "engram_config" not in kw and kw["additional_config"] == {}  # no Qwen4Exp settings
    assert "skip_tokenizer_init" not in kw and kw["enable_mm_embeds"] is True  # the multimodal path kept
    assert kw["limit_mm_per_prompt"] == {"image": 0, "audio": 0}
    kw, plugin = db.engine_kwargs(a, "uva_hot", "/m", True)
    hot = kw["additional_config"]["uvaple"]
    assert plugin and hot["hot_cache_gb"] > 0 and hot["hot_profile"] == "/w/hot_profile.npy"
    assert "gdn_prefill_backend" not in kw["additional_config"]
    kw, _ = db.engine_kwargs(SimpleNamespace(**dict(vars(a), model="qwen4exp")), "hbm", "/m", True)
    assert kw["skip_tokenizer_init"] is True and "enable_mm_embeds" not in kw  # Qwen4Exp's as before


def test_gemma3ns_prompts_and_hot_profile_follow_one_zipf_law(tmp_path):
    import random

    import numpy as np

    ids = db.prompt_ids(random.Random(1), 4096, 262144, True)
    assert len(ids) == 4096 and 16 <= min(ids) and max(ids) < 262144
    top = np.bincount(ids).argmax()
    assert np.bincount(ids)[top] > 4096 / 20  # the law's first rank: a token of ~1 in 10 (uniform: 1 in 262k)
    assert db.prompt_ids(random.Random(1), 4096, 262144, True) == ids  # the run's seed decides them
    flat = db.prompt_ids(random.Random(1), 4096, 262144, False)
    assert np.bincount(flat).max() <= 4
    prof = np.load(db.write_hot_profile(str(tmp_path / "p.npy"), 262144, n=1 << 14))
    assert prof.dtype == np.int64 and len(prof) == 1 << 14 and np.bincount(prof).argmax() == top  # the same law
    assert not np.array_equal(prof[:4096], ids)  # drawn apart from the prompts


@pytest.mark.parametrize("argv,match", [
    (["--model", "gemma3n", "--configs", "host"], "--configs host with --model gemma3n: vLLM keeps Gemma 3n's"),
    (["--configs", "uva_hot"], "--configs uva_hot with --model qwen4exp: the hot set is of token ids"),
    (["--model", "gemma3n", "--configs", "uva,uva_fp8row"], "--configs uva_fp8row with --model gemma3n: the plugin "
                                                            "quantises Qwen4Exp's n-gram tables only"),
    (["--model", "gemma3n", "--layers", "8"], "--layers with --model gemma3n: they shape Qwen4Exp"),
    (["--model", "gemma3n", "--ple-layer", "5"], "--ple-layer with --model gemma3n: they shape Qwen4Exp"),
    (["--model", "gemma"], "--model: invalid choice: 'gemma'"),
])
def test_a_configuration_that_is_not_the_models_is_named(argv, match):
    r = subprocess.run([sys.executable, str(CARRY / "decode_bench.py"), "--plan", *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and re.search(match, r.stderr), r.stderr


def test_gemma3ns_plan_names_its_engines():
    r = subprocess.run([sys.executable, str(CARRY / "decode_bench.py"), "--plan", "--model", "gemma3n"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert set(plan["engines"]) == {"hbm", "uva", "uva_hot"} and plan["plan"]["model"] == "gemma3n"
    assert all(e["model"] == "/tmp/vllm_decode_gemma3n/model" for e in plan["engines"].values())


def test_the_bad_settings_refusal_is_read_from_the_log_wherever_it_is_raised():
    msg = '--additional-config "uvaple".placement: expected one of [\'uva\', \'device\', \'copy\'], got \'gpu\''
    at_build = f"Traceback ...\nuvaple.integration.models.vllm.config.PluginConfigError: {msg}\n"
    at_config = f"pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n  Value error, {msg}"
    assert ec._names_the_bad_placement(at_build) and ec._names_the_bad_placement(at_config)
    assert not ec._names_the_bad_placement("RuntimeError: Engine core initialization failed")
    assert not ec._names_the_bad_placement(f"ValueError: {msg}")  # not the plugin's, nor vLLM's config


def test_the_in_process_graph_level_runs_every_engine_core_in_process_and_is_compared_apart(tmp_path):
    """``--graph-levels inproc``: the graph engines again with the core in the run's own process (every prompt
    queued before the first step), keyed and compared apart from vLLM's default layout, which stays out of
    process; eager engines are in process either way."""
    def env(mode, config, level):
        spec = {"mode": mode, "config": config, "level": level, "logging_config": str(tmp_path / "l.json"),
                "cache_root": str(tmp_path / "c")}
        return ec.child_env(spec).get("VLLM_ENABLE_V1_MULTIPROCESSING")

    assert env("graph", "device", "default") is None and env("graph", "device", "inproc") == "0"
    assert env("eager", "device", "eager") == "0" and env("graph", "hbm_inproc", "default") == "0"
    a = SimpleNamespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"), deadline_s=60.0, force=False)
    check = ec.Check(a)
    assert check.run_key("gemma3n", "graph", "device", "inproc") == "gemma3n.graph-inproc.device"
    toks, lp = [[5, 6]], [[[-0.1, -2.5], [-0.2, -3.0]]]
    moved = json.loads(json.dumps(lp))
    moved[0][1][1] = -3.1
    check.compare("gemma3n", "graph", "default", {"hbm": _run(toks, lp), "device": _run(toks, moved)})
    check.compare("gemma3n", "graph", "inproc", {"hbm": _run(toks, lp), "device": _run(toks, lp)})
    summary = check.summary()
    assert summary["gemma3n.graph"]["device"] == "same tokens, 1 of 4 logprobs differ"
    assert summary["gemma3n.graph-inproc"]["device"] == "identical"
    with pytest.raises(SystemExit):
        ec.main(["--graph-levels", "default,threads", "--checkpoints-only", "--work", str(tmp_path / "w")])


def test_serve_runs_the_bad_setting_first_and_each_step_only_where_its_time_is_left(tmp_path, monkeypatch):
    """The serve phase: the bad setting (seconds, now that the plugin's check runs as vLLM builds its config)
    before the good server; a step the time left cannot hold is left to the next call with a note; a step done
    is not repeated, and the good server's record keeps the bad setting's."""
    a = SimpleNamespace(out=str(tmp_path / "out"), work=str(tmp_path / "work"), deadline_s=60.0, force=False,
                        serve_model="qwen4exp_bf16")
    check = ec.Check(a)
    ran = []

    def refuses(spec, env):
        ran.append("bad")
        return {"refused": True}

    def good():
        ran.append("good")
        check._new_serve_record("qwen4exp_bf16")["ok"] = True

    monkeypatch.setattr(check, "_serve_refuses", refuses)
    monkeypatch.setattr(check, "_serve_good", good)
    monkeypatch.setattr(check, "_serve_env", lambda spec: {})
    left = {"s": ec.Check.BAD_SETTING_NEEDS_S + 1.0}
    monkeypatch.setattr(check, "left", lambda: left["s"])
    check.serve()  # time for the bad setting, not for the good server
    assert ran == ["bad"] and check.res["serve"]["bad_setting_refused"] is True
    assert any("serve: skipped" in n for n in check.res["notes"])
    left["s"] = ec.Check.SERVE_NEEDS_S + 1.0
    check.serve()  # the next call: the good server only
    assert ran == ["bad", "good"]
    assert check.res["serve"]["ok"] and check.res["serve"]["bad_setting_refused"] is True
    check.serve()
    assert ran == ["bad", "good"]  # both done
    assert ec.Check.BAD_SETTING_NEEDS_S + ec.Check.SERVE_NEEDS_S < 480  # both fit one call's default deadline
