"""``uvaple bench`` (perf/bench.py): a tiny sweep writes well-formed JSON/CSV/PNG and the providers agree.

Runs on CPU under the Triton interpreter (chosen for CPU tensors); on a GPU machine the same
tiny sweep runs on CUDA.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from uvaple.perf import bench

E4B = bench.ROW_BYTES["e4b"]
TINY_TABLE_GIB = 2 / 1024  # 2 MiB: 117 E4B rows


def _tiny_config(**kw) -> bench.BenchConfig:
    base = dict(
        row_bytes=(E4B,), rows=(1, 8), table_gib=(TINY_TABLE_GIB,), readiness_gib=(4 / 1024,),
        safetensors_max_gib=4 / 1024, point_time_s=0.0, min_reps=2, max_reps=2, warmup=1,
        graph_calls=2, graph_replays=2, copy_in_flight=2, verbose=False,
    )
    base.update(kw)
    return bench.make_config("quick", **base)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    cfg = _tiny_config()
    meta = bench.collect_meta(cfg)
    rows = bench.run_bench(cfg, meta=meta)
    out = tmp_path_factory.mktemp("bench")
    written = bench.write_results(rows, out, meta, plots=True, config=cfg)
    return cfg, meta, rows, written


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def test_every_provider_agrees_with_uva(sweep):
    cfg, _meta, rows, _ = sweep
    gather = [r for r in rows if r["kind"] == "gather"]
    assert len(gather) == len(cfg.rows) * len(cfg.providers)
    for r in gather:
        assert not r["error"], (r["provider"], r["n"], r["error"])
        want = "n/a" if r["provider"] == bench.CEILING else "ok"
        assert r["check"] == want, (r["provider"], r["n"], r["check"])
    assert bench.exit_code(rows) == 0


def test_json_rows_are_well_formed(sweep):
    cfg, meta, _rows, written = sweep
    doc = json.loads(written["json"].read_text())
    assert doc["meta"]["mode"] == ("gpu" if torch.cuda.is_available() else "cpu-interpreter")
    for key in ("gpu_name", "driver", "pcie_link", "torch", "triton", "git_commit", "timestamp"):
        assert key in doc["meta"]
    gather = [r for r in doc["rows"] if r["kind"] == "gather"]
    ready = [r for r in doc["rows"] if r["kind"] == "readiness"]
    assert gather and ready
    for r in gather:
        for key in ("us_median", "us_p20", "us_p80", "gbps", "x_ceiling", "x_uva", "cpu_s_per_lookup"):
            assert _finite(r[key]), (r["provider"], key, r[key])
        assert r["us_p20"] <= r["us_median"] <= r["us_p80"]
        assert r["gbps"] > 0
        assert r["row_bytes"] == E4B and r["cols"] == E4B // 2
        for key in ("meta_gpu_name", "meta_driver", "meta_pcie_link", "meta_torch", "meta_triton",
                    "meta_git_commit", "meta_timestamp"):
            assert key in r
    uva = [r for r in gather if r["provider"] == "uva"]
    assert all(r["x_uva"] == pytest.approx(1.0) for r in uva)
    for method in ("HostTable.empty", "HostTable.from_safetensors"):
        sel = [r for r in ready if r["method"] == method]
        assert sel and all(r["check"] == "ok" and _finite(r["seconds"]) and r["seconds"] > 0 for r in sel)


def test_csv_matches_json(sweep):
    _cfg, _meta, rows, written = sweep
    with open(written["csv_gather"], newline="") as f:
        table = list(csv.DictReader(f))
    gather = [r for r in rows if r["kind"] == "gather"]
    assert len(table) == len(gather)
    for key in ("provider", "row_bytes", "n", "us_median", "gbps", "x_ceiling", "x_uva", "check",
                "meta_gpu_name", "meta_pcie_link", "meta_git_commit"):
        assert key in table[0]
    for r in table:
        assert math.isfinite(float(r["us_median"])) and float(r["gbps"]) > 0
    with open(written["csv_readiness"], newline="") as f:
        assert list(csv.DictReader(f))


def test_plots_are_png(sweep):
    _cfg, _meta, _rows, written = sweep
    pytest.importorskip("matplotlib")
    for key in ("plot_gather", "plot_readiness"):
        data = written[key].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_summary_and_banner(sweep):
    _cfg, meta, _rows, written = sweep
    text = written["summary"].read_text()
    assert "provider" in text and "memcpy-ceiling" in text
    if meta["mode"] != "gpu":
        assert "NOT GPU figures" in bench.banner(meta)


def _row(**kw):
    row = bench.empty_row({"gpu_name": "X"}, provider="uva", row_label="E4B", row_bytes=E4B, cols=E4B // 2,
                           n=64, table_gib=8.0, check="ok")
    row.update(kw)
    return row


def test_format_table_lines():
    rows = [
        _row(us_median=28.04, us_p20=27.5, us_p80=29.25, gbps=40.96, x_ceiling=0.8, x_uva=1.0,
             graph_us_median=20.5, graph_x_ceiling=0.93, cpu_s_per_lookup=12e-6, gpu_mem_bytes=0),
        _row(provider="device", check="skipped", error="skipped: the table does not fit"),
        {"kind": "readiness", "method": "HostTable.empty", "table_gib": 1.0, "seconds": 0.5, "gib_per_s": 2.0,
         "check": "ok", "error": ""},
    ]
    text = bench.format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 3  # header + two gather rows; readiness rows are not gather lines
    head = lines[0].split()
    assert head[:6] == ["provider", "table", "row_B", "n", "us_med", "p20-p80"]
    first = lines[1].split()
    assert first[:9] == ["uva", "8GiB", str(E4B), "64", "28.0", "27.5-29.2", "40.96", "0.80", "1.00"]
    assert first[9:13] == ["20.50", "0.93", "12.0", "0"] and first[-1] == "ok"
    second = lines[2]
    assert second.split()[4] == "-" and "[skipped: the table does not fit]" in second
    ready = bench.format_readiness_table(rows).splitlines()
    assert len(ready) == 2 and ready[1].split()[:4] == ["HostTable.empty", "1GiB", "0.500", "2.00"]


def test_exit_code():
    assert bench.exit_code([_row()]) == 0
    assert bench.exit_code([_row(), _row(check="error")]) == 3  # its own status: 2 is a refusal before any work
    assert bench.exit_code([_row(check="error"), _row(check="MISMATCH")]) == 1


def test_parse_args():
    ns = bench.parse_args(["--row-bytes", "e2b,e4b,ngram,4096", "--rows", "1,8", "--providers", "uva,copy",
                           "--table-gib", "1,0.5", "--out", "x", "--no-plots"])
    cfg = bench.config_from_args(ns)
    assert cfg.row_bytes == (15360, 17920, 131072, 4096)
    assert cfg.rows == (1, 8) and cfg.providers == ("uva", "copy") and cfg.table_gib == (1.0, 0.5)
    assert cfg.out == "x" and cfg.plots is False
    with pytest.raises(SystemExit):
        bench.parse_args(["--providers", "nope"])
    full = bench.make_config("full", cuda=True)
    assert full.table_gib == (1.0, 8.0, 32.0, 64.0) and 64.0 in full.readiness_gib
    assert bench.make_config("full", cuda=False).preset == "cpu"


def test_mismatch_and_errors_are_reported(monkeypatch):
    from uvaple.perf import peers

    real = peers.row_gather

    def broken(table, ids, out):  # a peer that gets one row wrong
        real(table, ids, out)
        out[0].view(torch.int16).bitwise_xor_(1)
        return out

    def failing(view, ids):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(peers, "row_gather", broken)
    monkeypatch.setattr(peers, "embedding_gather", failing)
    cfg = _tiny_config(rows=(4,), readiness_gib=(), providers=("uva", "peer-row-triton",
                                                                "torch-embedding-uva", "memcpy-ceiling"))
    rows = bench.run_bench(cfg)
    by = {r["provider"]: r for r in rows}
    assert by["uva"]["check"] == "ok"
    assert by["peer-row-triton"]["check"] == "MISMATCH" and by["peer-row-triton"]["mismatch_rows"] == 1
    assert by["torch-embedding-uva"]["check"] == "error" and "planted failure" in by["torch-embedding-uva"]["error"]
    assert by["memcpy-ceiling"]["gbps"] > 0  # the run went on
    assert bench.exit_code(rows) == 1


def test_main_cli(tmp_path, capsys):
    code = bench.main(["--row-bytes", "e4b", "--rows", "2", "--table-gib", str(TINY_TABLE_GIB),
                       "--providers", "uva,copy,memcpy-ceiling", "--no-readiness", "--no-plots", "--quiet",
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert (tmp_path / "results.json").exists() and (tmp_path / "gather.csv").exists()
    assert f"results in {tmp_path}" in out
    assert "uva" in out and "copy" in out


def test_format_headline():
    rows = [
        _row(n=1, us_median=20.0, gbps=0.9, graph_us_median=6.0),
        _row(n=16384, us_median=5800.0, gbps=50.6),
        _row(provider="copy", n=16384, us_median=9000.0, gbps=32.6),
        _row(provider="device", n=16384, check="skipped", error="skipped: no room"),
    ]
    lines = bench.format_headline(rows).splitlines()
    assert len(lines) == 2
    assert "n=16384" in lines[0] and "uva 50.6" in lines[0] and "copy 32.6" in lines[0] and "dev skipped" in lines[0]
    assert "n=1 " in lines[1] and "uva 20.0 (graph 6.0)" in lines[1]


def test_time_budget_skips_tables():
    cfg = _tiny_config(rows=(1,), providers=("uva",), table_gib=(TINY_TABLE_GIB, TINY_TABLE_GIB),
                       readiness_gib=(), time_budget_s=1e-9)
    rows = bench.run_bench(cfg)
    assert rows and all(r["check"] == "skipped" and "time budget" in r["error"] for r in rows)
    assert bench.exit_code(rows) == 0


def test_host_workload_with_the_launch_stubbed_times_the_lookups_own_layers_and_puts_the_launch_back(tmp_path,
                                                                                                     capsys):
    """``uvaple bench --workload host --stub-launch`` runs on a CPU: the lookup's rows checked once (interpreted),
    then the lookup, the plan, its direct gather and the bare call timed with the compiled kernel stood in for by a
    no-op; afterwards the launcher is interpreted again, with nothing kept, and Triton's driver getters are back;
    --smoke beside it is refused by name."""
    import json

    from uvaple.kernels import launch as launch_mod
    from uvaple.perf import bench, host_cost

    before = dict(vars(launch_mod._Driver))
    assert bench.main(["--workload", "host", "--stub-launch", "--calls", "50", "--rows", "1,5",
                       "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "host_cost.json").read_text())
    assert result["stub_launch"] and "launch stubbed" in result["device"]
    assert set(result["rows"]) == {"1", "5"}
    for row in result["rows"].values():
        assert set(row) == {"lookup", "plan", "direct", "bare"}
        assert all(r["exact"] and r["median_us"] > 0 for r in row.values())
        assert row["lookup"]["above_bare_us"] == round(row["lookup"]["median_us"] - row["bare"]["median_us"], 2)
    assert dict(vars(launch_mod._Driver)) == before
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("ids"))
    assert "--stub-launch" in out and header.split() == ["ids", "lookup", "plan", "direct", "bare", "lk-bare", "us"]
    assert host_cost.main(["--smoke", "--stub-launch", "--out", str(tmp_path)]) == 2
    assert "pick one" in capsys.readouterr().err


def test_the_host_workloads_queries_are_the_direct_gathers_own_and_each_is_timed(monkeypatch):
    """The per-call queries the host workload times on a GPU are the ones the direct gather makes (the launcher's
    device and stream getters, the capture check, the hook check), each callable alone."""
    from uvaple.kernels import capture
    from uvaple.kernels import launch as launch_mod
    from uvaple.perf import host_cost

    asked = []
    monkeypatch.setattr(launch_mod._Driver, "device", staticmethod(lambda: asked.append("device") or 0))
    monkeypatch.setattr(launch_mod._Driver, "stream", staticmethod(lambda i: asked.append(("stream", i)) or 0))
    q = host_cost._queries(3)
    assert list(q) == ["nothing", "current_device", "current_stream", "capturing", "hooks"]
    assert q["capturing"] is capture._stream_capturing and q["hooks"] == launch_mod._Hooks.set
    if not torch.cuda.is_available():  # a CPU build's capture query is a placeholder that raises when called
        q.pop("capturing")
    times = host_cost.measure(q, calls=20, block=5, sync_every=8, cuda=False)
    assert all(len(ts) == 20 and min(ts) >= 0 for ts in times.values())
    assert asked.count("device") == 40 and asked.count(("stream", 3)) == 40  # 20 warm-up calls, 20 timed


def test_host_workload_smoke_is_exact(tmp_path, capsys, monkeypatch):
    """``uvaple bench --workload host --smoke``: every provider (the lookup, the lookup allocating its output, the
    lookup on the Python path, the operator given the lookup's plan, the functional gather, the plan alone, its
    direct gather alone, the bare launch, torch's index_select and embedding) gives index_select's rows, and the
    run writes its figures with the lookup's cost above the bare launch."""
    import json

    from uvaple.perf import bench, host_cost

    # 4 timed calls a provider in blocks of 2 (the smoke's 40 in blocks of 10 time the interpreter, not the rows)
    monkeypatch.setitem(host_cost.SMOKE, "calls", 4)
    monkeypatch.setitem(host_cost.SMOKE, "block", 2)
    assert bench.main(["--workload", "host", "--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "host_cost.json").read_text())["rows"]
    assert set(rows) == {"1", "7"}
    for row in rows.values():
        assert set(row) == {"lookup", "alloc", "python", "operator", "gather_rows", "plan", "direct", "bare",
                            "index_select", "embedding"}
        assert all(r["exact"] and r["median_us"] > 0 for r in row.values())
        assert row["lookup"]["above_bare_us"] == round(row["lookup"]["median_us"] - row["bare"]["median_us"], 2)
    assert "lk-bare us" in capsys.readouterr().out
