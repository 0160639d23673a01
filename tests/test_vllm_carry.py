"""The vLLM engine scripts' own logic (``perf/vllm_carry/``: run on the GPU machine with vLLM carried there), on
a CPU: the decode benchmark's model plan, figures and refusals, the engine check's comparison of two engines."""

from __future__ import annotations

import json
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


def test_each_configuration_is_the_engine_it_names():
    a = SimpleNamespace(batches=[1, 8, 32, 64], prompt=512, decode=256)
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


@pytest.mark.parametrize("argv,match", [
    (["--configs", "hbm,gpu"], "--configs: \\['gpu'\\]"),
    (["--batches", "1,x"], "--batches: expected comma-separated integers"),
    (["--batches", "0"], "--batches: positive"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--decode", "1"], "--decode must be at least 2"),
    (["--layers", "6"], "--layers '6': --layers must be a multiple of 4"),
    (["--table-gib", "-1"], "--table-gib must be in"),
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
    md = db.markdown(t, res, db.plan_model(24.0, 8, 512), SimpleNamespace(prompt=512, decode=256, reps=3))
    assert "| uva | 8 | 769.2 [733.9-784.3] |" in md


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


# ------------------------------------------------------------------ engine_check: comparing engines
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


def test_every_configuration_has_a_reference_that_runs_where_it_runs():
    for model in ec.MODELS:
        for mode in ec.MODES:
            for c in ec.CONFIGS:
                if ec.applies(c, model, mode) and "expect" not in ec.CONFIGS[c]:
                    assert ec.applies(ec.reference(c), model, mode), (c, model, mode)
    assert not ec.applies("host", "gemma3n", "eager")  # vLLM has no host path for Gemma 3n
    assert not ec.applies("copy_again", "qwen4exp_bf16", "graph")
    assert ec.CONFIGS["copy"]["expect"]["graph"] in "placement 'copy' cannot run inside vLLM's CUDA graphs (each"
