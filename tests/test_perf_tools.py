"""The tuning scripts run (tiny sizes, CPU): their output has every column and a verdict."""

from __future__ import annotations

from uvaple.perf import tune_copy


def test_tune_copy_runs_and_reports_torch_beside_numba(tmp_path):
    out = tmp_path / "tune.log"
    assert tune_copy.main(["--table-gib", "0.01", "--max-bytes", "16384", "--budget-s", "0.001",
                           "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert "torch_us" in lines[1] and "best_numba/torch" in lines[1]
    rows = [line.split() for line in lines[2:-1]]
    assert [(r[0], r[1]) for r in rows] == [(rb, str(sz)) for rb in ("160", "17920") for sz in (4096, 8192, 16384)]
    assert all(len(r) == 8 and float(r[6]) > 0 for r in rows)
    assert lines[-1].startswith("# parallel wins from:")
