"""The Qwen4Exp end-to-end study (``perf/studies/qwen4_exp_e2e.py``), run here on its toy config.

The study measures on the GPU machine; here ``--smoke-cpu`` checks the script itself on the CPU (Triton
interpreter): without CUDA it refuses by name; a build it cannot serve (an fp8 table from tables never in HBM) is
named before anything is built; its host build (tables that do not fit the GPU, built and filled in host memory)
gives transformers' own tokens and logits from the same bytes; its disk phase serves ``uva``'s tokens from table
files. In a file of their own so that the test workers run them beside ``test_qwen4_exp.py``'s, not after them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'uvaple[hf]')")
pytest.importorskip("transformers.models.qwen4_exp", reason="this transformers has no Qwen4Exp (5.17 or later)")

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "perf" / "studies" / "qwen4_exp_e2e.py"


def smoke(*args: str, timeout: float = 540) -> subprocess.CompletedProcess:
    """The study on its toy config on the CPU (``--smoke-cpu``) with ``args``."""
    return subprocess.run([sys.executable, str(STUDY), "--smoke-cpu", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_the_e2e_study_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("the study runs here; perf/studies/qwen4_exp_e2e.py is measured on the GPU machine")
    run = subprocess.run([sys.executable, str(STUDY), "--json", "-"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


@pytest.mark.extended  # ~30 s on 2 cores, up to 150 s on a loaded 16-core host: three eager models of the toy config
@pytest.mark.timeout(600)
def test_the_e2e_studys_disk_phase_serves_uvas_tokens_from_files_and_counts_the_cache(tmp_path):
    out = tmp_path / "disk.json"
    run = smoke("--phases", "disk", "--disk-fractions", "0.5,0.01", "--batches", "2", "--scratch", str(tmp_path),
                "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and set(res["disk"]) >= {"uva", "disk_0.5", "disk_0.01"}
    for name in ("disk_0.5", "disk_0.01"):
        r = res["disk"][name]
        assert r["tokens_equal_uva"] is True and set(r["decode_tok_s"]) == set(r["ple_layer_step_us"]) == {"2"}
        assert r["cache"]["misses"] > 0 and r["cache"]["pages_read"] > 0 and 0 <= r["cache"]["hit_rate"] < 1
    small, large = res["disk"]["disk_0.01"], res["disk"]["disk_0.5"]
    assert small["slots"] < large["slots"] == -(-large["of_rows"] // 2)  # a hundredth: a forward's rows at least
    assert small["cache"]["evictions"] > 0 == large["cache"]["evictions"]  # the small cache evicted, served alike
    assert not any(p.name.startswith("uvaple_disk_phase") for p in tmp_path.iterdir())  # the files are removed


def test_the_e2e_study_refuses_an_fp8_table_from_a_host_build_before_building(tmp_path):
    out = tmp_path / "r.json"
    run = smoke("--phases", "main", "--build", "host", "--table", "fp8", "--json", str(out), timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--table fp8 resolved to fp8" in run.stderr and "pass --table bf16" in run.stderr
    assert "[build]" not in run.stderr and not out.exists()  # named before anything was built or written


@pytest.mark.extended  # ~50 s on 2 cores: transformers' path and ours on the toy config, a 16-token prefill
@pytest.mark.timeout(600)
def test_the_e2e_studys_host_build_gives_transformers_tokens_from_tables_never_on_the_device(tmp_path):
    out = tmp_path / "host.json"
    run = smoke("--phases", "main", "--build", "host", "--table", "bf16", "--batches", "", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["errors"] == [] and res["build_kind"] == "host" and res["table"] == "bf16"
    assert res["real_table_gib"] > 0 and 0.015 < res["table_sample_std"] < 0.025  # filled: normal(0, init range)
    bf16 = res["bf16"]
    assert "swap" not in bf16  # served from the tables it was built with: nothing copied
    assert "transformers_cpu_path_equals_its_hbm_path" not in bf16  # no HBM table to compare with
    assert bf16["transformers_cpu_path_repeats"] is True and bf16["prefill_logits_finite"] is True
    assert bf16["tokens_equal_transformers"] is True and bf16["prefill_logits_bit_identical"] is True
    assert bf16["prefill_ms"]["16"]["logits_equal"] is True
