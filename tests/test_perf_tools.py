"""The tuning scripts and probes of ``perf/studies/`` run (tiny sizes, CPU): their output has every column and a
verdict; the GPU-only ones say so without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import study

from uvaple.integration.placements import host_gather as cpu_gather

tune_copy = study("tune_copy")


def test_tune_copy_runs_and_reports_torch_beside_numba(tmp_path):
    out = tmp_path / "tune.log"
    assert tune_copy.main(["--table-gib", "0.01", "--max-bytes", "16384", "--budget-s", "0.001",
                           "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# tune_copy:") and "TORCH_MIN_BYTES=" in lines[0]
    assert lines[1].split() == ["row_B", "bytes", "rows", "serial_us", "parallel_us", "par/ser", "torch_us",
                                "best_numba/torch", "torch_path_us", "path", "gather_us", "gather/torch",
                                "par_words_us", "prefetch_us", "pf/par_words"]
    rows = [line.split() for line in lines[2:-2]]
    assert [(r[0], r[1]) for r in rows] == [(rb, str(sz)) for rb in ("160", "1024", "4096", "17920")
                                            for sz in (4096, 8192, 16384)]
    assert all(len(r) == 15 and all(float(r[c]) > 0 for c in (6, 8, 10, 12, 13)) for r in rows)
    # the backend's own choice for each request: serial below PARALLEL_MIN_BYTES (8 KiB), then parallel
    assert [r[9] for r in rows] == [cpu_gather.gather_path(int(r[2]), int(r[0])) for r in rows]
    assert [r[9] for r in rows if r[0] == "1024"] == ["serial", "parallel", "parallel"]
    assert lines[-2].startswith("# the torch path beats the better numba gather from:")
    assert lines[-1].startswith("# parallel wins from:")


def test_tune_copy_reports_the_torch_path_where_the_backend_takes_it(tmp_path):
    out = tmp_path / "tune.log"
    assert tune_copy.main(["--table-gib", "0.02", "--max-bytes", str(4 << 20), "--budget-s", "0.001",
                           "--row-bytes", "160", "--out", str(out)]) == 0
    rows = [r.split() for r in out.read_text().splitlines()[2:-2]]
    assert [r[9] for r in rows] == [cpu_gather.gather_path(int(r[2]), 160) for r in rows]
    assert torch.get_num_threads() >= cpu_gather._numba_threads()  # tune_copy gives torch every core
    assert rows[-1][1] == str(4 << 20) and cpu_gather.TORCH_MIN_BYTES <= (4 << 20) - 160
    assert rows[-1][9] == "torch"


def hotset_smoke(tmp_path, ns: list[int], trace_ids: int = 20_000) -> None:
    """``uvaple bench --workload hotset --smoke`` of calls of ``ns`` ids: every lossless provider bit-exact, the
    fp8 error and the held-out hit rate reported (a Zipf profile and serve trace of different seeds, of ``trace_ids``
    ids each: the online set counts the first half of the served trace, at most 4,096 ids)."""
    import numpy as np

    from uvaple.commands.cli import main
    from uvaple.perf import hotset

    profile, serve = hotset.zipf_ids(trace_ids, 4096, seed=1), hotset.zipf_ids(trace_ids, 4096, seed=2)
    np.save(tmp_path / "profile.npy", profile)
    (tmp_path / "serve.txt").write_text(" ".join(map(str, serve)))
    assert main(["bench", "--workload", "hotset", "--smoke", "--rows", ",".join(map(str, ns)), "--profile-ids",
                 str(tmp_path / "profile.npy"), "--serve-ids", str(tmp_path / "serve.txt"),
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "hotset.json").read_text())
    assert res["traces"] == "files" and [r["n"] for r in res["results"]] == ns
    assert all(all(r["bit_exact"].values()) for r in res["results"])
    held = np.zeros(4096, dtype=bool)
    held[np.argsort(-np.bincount(profile, minlength=4096), kind="stable")[: res["hot_rows"]]] = True
    half = len(serve) // 2  # every provider is timed on the served trace's second half
    assert abs(res["held_out_hit_rate"] - held[serve[half:]].mean()) < 1e-6 and 0.5 < res["held_out_hit_rate"] < 1
    # the online set: the same slots ranked on the profile plus the first half's served ids (4,096 at most in a smoke)
    warm = min(half, 4096)
    counts = np.bincount(profile, minlength=4096) + np.bincount(serve[:warm], minlength=4096)
    online = np.zeros(4096, dtype=bool)
    online[np.argsort(-counts, kind="stable")[: res["online_rows"]]] = True
    assert res["online_warm_ids"] == warm and res["online_rows"] == 204
    assert abs(res["online_held_out_hit_rate"] - online[serve[half:]].mean()) < 1e-6
    assert all(r["bit_exact"]["hot_online"] and r["bit_exact"]["hot_dedup"] and r["bit_exact"]["all_auto_vs_fp8"]
               for r in res["results"])
    assert 0 < res["fp8_error"]["max_rel"] <= 2 ** -4 + 2 ** -8


def test_hotset_bench_smoke_of_two_sizes_is_exact_and_reports_the_held_out_hit_rate(tmp_path):
    """The smoke below, of calls of 1 and 16 ids, on traces of 4,000 ids (2,000 served ids counted interpreted)."""
    hotset_smoke(tmp_path, [1, 16], trace_ids=4_000)


@pytest.mark.extended  # 35-45 s on 2 cores (135 s seen on a loaded one)
def test_hotset_bench_smoke_is_exact_and_reports_the_held_out_hit_rate(tmp_path):
    """The smoke of calls of 1, 64 and 200 ids."""
    hotset_smoke(tmp_path, [1, 64, 200])


def test_memlock_probe_runs_every_case_in_a_child_with_the_low_limit(tmp_path):
    memlock_probe = study("memlock_probe")
    out = tmp_path / "memlock.json"
    assert memlock_probe.main(["--gib", "0.001", "--limit-kib", "64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["limit_bytes"] == 64 << 10 and set(res["cases"]) == {name for name, _ in memlock_probe.cases()}
    for case in res["cases"].values():
        assert case["memlock_soft"] == case["memlock_hard"] == 64 << 10  # the child ran under the low limit
        want = {"registered", "refused"} if torch.cuda.is_available() else {"no_gpu"}
        assert case["outcome"] in want, case
        if case["outcome"] == "registered":
            assert case["exact"] and case["registered_bytes"] >= 1 << 20


def test_memlock_probe_fails_a_refusal_that_does_not_say_what_to_do(monkeypatch):
    memlock_probe = study("memlock_probe")
    monkeypatch.setattr(memlock_probe, "CHILD", 'print(\'{"outcome": "refused", "error": "no reason given"}\')')
    rep = memlock_probe.run_case([], 0.001, 64 << 10)
    assert rep["outcome"] == "failed" and "ulimit -l" in rep["why_failed"]
    monkeypatch.setattr(memlock_probe, "CHILD", "import sys; sys.exit(3)")
    assert memlock_probe.run_case([], 0.001, 64 << 10)["outcome"] == "failed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU these run their measurement")
@pytest.mark.parametrize("name", ["host_rates", "lifetime_gpu", "split_costs", "split_profile",
                                  "tune_gather", "ngram_layer"])
def test_gpu_only_measurements_say_they_need_a_gpu(name, capsys):
    """Each GPU-only measurement, run where no CUDA device is, exits with status 2 and says what it needs,
    before building anything (no table, no lookup)."""
    mod = study(name)
    assert mod.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.extended
def test_ngram_layer_smoke_gives_transformers_rows_and_ids(tmp_path):
    """The n-gram embedding study's smoke (CPU, kernels interpreted): ours gives transformers' rows bit for bit
    and the hash kernel the definition's ids at every shape, and the figures are written."""
    out = tmp_path / "nl.json"
    assert study("ngram_layer").main(["--smoke", "--reps", "1", "--calls", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["results"]
    assert set(got) == {"decode b1", "decode b3", "prefill 9"}
    assert all(r["rows_bit_identical"] and r["ids_identical"] and r["ours_us"]["n"] == 1 for r in got.values())


def test_disk_host_path_study_times_each_part_of_a_call(tmp_path, capsys):
    """The disk placement's host-work study, small: both modes write each batch's medians, the call and its parts
    (reads, plan and copy, the rest), the reads zero where none are made; a bad count is refused."""
    out = tmp_path / "d.json"
    mod = study("disk_host_path")
    for reads in ("file", "none"):
        assert mod.main(["--rows", "4096", "--batches", "1,2", "--steps", "8", "--warm", "2", "--runs", "1",
                         "--reads", reads, "--dir", str(tmp_path), "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["reads"] == reads and set(got["batches"]) == {"1", "2"}
        for b in got["batches"].values():
            m = b["median_us"]
            assert m["call"] > 0 and m["plan_copy"] > 0 and m["rest"] > 0 and (m["pages"] > 0) == (reads == "file")
    assert "batch   2 (none)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mod.main(["--steps", "0"])
    assert "--steps 0 (>= 1)" in capsys.readouterr().err


def test_the_gpu_suites_groups_name_existing_test_files_once_each():
    """``TEST_GROUPS=suite`` in ``perf/gpu_check.sh``: as many groups as its usage text says, each group's files
    exist and no file runs twice (a file in no group runs as a group of its own there)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "perf" / "gpu_check.sh").read_text()
    groups = re.search(r'^SUITE_GROUPS="(.*?)"$', text, re.M | re.S).group(1).replace("\\\n", "").split(";")
    files = [f for g in groups for f in g.split()]
    said = re.search(r"every test file in the (\w+) groups below", text).group(1)
    count = {"eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15}.get(said)
    assert len(groups) == count, f"gpu_check.sh's usage says {said} groups, SUITE_GROUPS has {len(groups)}"
    assert all(g.split() for g in groups)
    assert [f for f in files if not (root / f).is_file()] == [] and len(files) == len(set(files))
    missing = {f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")} - set(files)
    assert not missing, f"add {sorted(missing)} to a group of SUITE_GROUPS in perf/gpu_check.sh"


def test_the_gpu_checks_source_digest_names_the_sources_by_content(tmp_path):
    """``bash perf/gpu_check.sh digest``: 16 hex digits of the sources' paths and contents, the same in a copy of
    the tree, another where one source changed; nothing else runs (no GPU machine's steps, no output folder)."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "tree"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".git", ".venv*", ".vllm-carry", "__pycache__",
                                                               "results", "*.egg-info", "gpu-out"))

    def digest(where: Path) -> str:
        run = subprocess.run(["bash", "perf/gpu_check.sh", "digest"], cwd=where, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0 and run.stderr == "", run.stderr
        return run.stdout.strip()

    here = digest(root)
    assert re.fullmatch(r"[0-9a-f]{16}", here) and digest(copy) == here and not (copy / "gpu-out").exists()
    (copy / "kernels" / "plan.py").write_text((copy / "kernels" / "plan.py").read_text() + "\n")
    assert digest(copy) != here
