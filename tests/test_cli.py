"""The command line as a new user meets it: ``uvaple``, ``uvaple doctor``, ``uvaple bench`` (every workload) and
``uvaple shm``.

Each test names the point of the CLI issue it covers:

1. help texts true (defaults, ``--workload`` and its choices, ``--out``'s real default; every workload takes
   ``--out``, ``--smoke`` and ``--quiet``);
2. ``doctor``'s exit statuses (0 usable, 1 the measurement failed, 2 usage, 3 no usable GPU) and its last line;
3. ``bench`` refuses up front, before any table is built, what this machine cannot run, naming the flag that
   can (exit 2, no traceback);
4. ``--out`` made and checked before any work; every run writes its results (or says it wrote none), the
   last line names where;
5. progress on stderr (tqdm), stdout kept for results, ``--quiet`` silences it;
6. ``shm list`` shows the table's bytes.

The vLLM plugin's point (a warning for a ``"uvaple"`` entry the plugin never reads) is in
``tests/test_vllm_config.py``. Nothing here runs a benchmark: the workloads' measurements are stubbed where a
test only checks the command line around them (their smoke runs are tested in ``test_bench.py``,
``test_perf_tools.py`` and ``test_vllm_perf.py``).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch

from uvaple.commands.cli import main
from uvaple.perf import bench, command, host_cost, hotset, ngram, vllm_shapes
from uvaple.uva import HostTable, system

HAS_CUDA = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="what a machine without CUDA is told")
WORKLOADS = ("ple", "ngram", "hotset", "host", "disk")


def _help(capsys, argv: list[str]) -> str:
    """The help text, its wrapping undone (argparse breaks lines at spaces and after hyphens)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split()).replace("- ", "-")


@pytest.fixture
def nothing_built(monkeypatch):
    """Building a host table fails the test: a refusal comes before any work."""
    def built(*args, **kwargs):
        raise AssertionError("a host table was built before the run was refused")

    for name in ("empty", "shared", "from_tensor", "from_safetensors"):
        monkeypatch.setattr(HostTable, name, built)


def _refused(capsys, argv: list[str], *names: str) -> str:
    """Run ``uvaple bench argv``: exit 2 within seconds, no traceback, stderr naming each of ``names`` and
    saying no results were written. Returns stderr."""
    t0 = time.perf_counter()
    code = main(["bench", *argv])
    took = time.perf_counter() - t0
    cap = capsys.readouterr()
    assert code == 2, cap
    assert took < 5, f"refused after {took:.1f} s"  # ~0.1 s: only checks, nothing built (nothing_built)
    assert "Traceback" not in cap.err and cap.out == ""
    for name in names:
        assert name in cap.err, (name, cap.err)
    assert cap.err.rstrip().endswith("nothing was run; no results written")
    return cap.err


# -------------------------------------------------------------------------------------------- 1. help
def test_top_level_help_lists_the_commands_and_their_statuses(capsys):
    """Point 1: ``uvaple --help`` names every command, the workloads, --smoke and --version; no command is a
    usage error (exit 2, on stderr)."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(w in out for w in ("doctor", "bench", "shm", "--workload", "--smoke", "--version", "3 no usable GPU"))
    assert main([]) == 2 and "usage: uvaple" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err


def test_bench_help_lists_workload_and_the_real_out_default(capsys):
    """Point 1: ``uvaple bench --help`` lists --workload with its choices and --out's real default
    (./uvaple-results/..., not perf/results/), and says what --smoke runs."""
    out = _help(capsys, ["bench", "--help"])
    assert "--workload {ple,ngram,hotset,host,disk}" in out
    assert "perf/results" not in out and "(default ./uvaple-results/<UTC time>_ple_<gpu or cpu>/)" in out
    assert "--smoke" in out and "exit status" in out
    meta = {"timestamp": "2026-12-03T19:40:04Z", "gpu_name": "NVIDIA H200", "mode": "gpu"}
    assert bench.default_out_dir(meta).relative_to(Path.cwd()).parts == (
        "uvaple-results", "20261203_194004_ple_NVIDIA-H200")  # what the help says: ./uvaple-results/..._ple_<gpu>


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_workload_takes_out_smoke_and_quiet_and_says_so(capsys, workload):
    """Point 1: each workload's help (``uvaple bench --workload NAME --help``) lists --out with its default,
    --smoke and --quiet, and its exit statuses."""
    out = _help(capsys, ["bench", "--workload", workload, "--help"])
    for flag in ("--out", "--smoke", "--quiet", "exit status", "2 refused before any work"):
        assert flag in out, (workload, flag)
    assert f"./uvaple-results/<UTC time>_{workload}_<gpu or cpu>/" in out


def test_ple_smoke_is_the_cpu_run_on_any_machine():
    """Point 1: ``uvaple bench --smoke`` (the ple workload) is the small CPU run, with or without CUDA."""
    cfg = bench.config_from_args(bench.parse_args(["--smoke"]))
    assert cfg.preset == "cpu" and cfg.cuda is False and max(cfg.table_gib) <= 4 / 1024


def test_doctor_and_shm_help_say_their_exit_statuses(capsys):
    """Points 1, 2: ``uvaple doctor --help`` documents 0, 1, 2 and 3; ``uvaple shm list --help`` says the
    table's bytes are shown."""
    out = _help(capsys, ["doctor", "--help"])
    assert "0 the UVA path is usable here" in out and "3 no usable GPU" in out and "2 usage error" in out
    assert "1 the GPU has the UVA path's capabilities, but its measurement failed" in out
    out = _help(capsys, ["shm", "--help"])
    assert "the table's bytes (rows x row stride)" in out


# -------------------------------------------------------------------------------------------- 2. doctor
def test_doctor_says_what_runs_here_and_ends_with_its_verdict(capsys):
    """Point 2: the report, then the verdict as the last line: exit 0 where the UVA path is usable, else
    3 with the reason (no CUDA GPU here)."""
    code = main(["doctor", "--no-measure"])
    out = capsys.readouterr().out
    huge = system.huge_pages_in("/dev/shm")  # this machine's /dev/shm, read from the mount table
    assert f"shared tables in /dev/shm     : {'2 MiB' if huge in ('always', 'within_size') else '4 KiB'} pages" in out
    last = out.rstrip().splitlines()[-1]
    if HAS_CUDA:
        assert code == 0 and last == "uvaple doctor: exit 0: the UVA path is usable here"
        assert "eager lookup call in C        : built" in out  # the GPU machine has a compiler and Python.h
    else:
        assert code == 3 and "What runs here instead:" in out
        assert "eager lookup call in C" not in out  # a GPU's line
        assert last.startswith("uvaple doctor: exit 3: no usable GPU for the UVA path here: no CUDA GPU is visible")
        assert "copy placement" not in out  # --no-measure: no CPU figures
        assert "CUDA build of torch" in out and "every lookup placement on CPU tensors" in out


def test_doctor_json_keeps_stdout_json_and_says_the_verdict_on_stderr(capsys, monkeypatch):
    """Point 2: with --json, stdout is the JSON (exit_status and verdict in it) and the verdict is stderr's
    last line."""
    from uvaple.commands import doctor

    monkeypatch.setattr(doctor, "_measure_cpu", lambda seconds: (1.0, 2.0))  # the report, not the figures
    code = main(["doctor", "--json", "--seconds", "0.1"])
    cap = capsys.readouterr()
    caps = json.loads(cap.out)
    assert caps["exit_status"] == code == (0 if HAS_CUDA else 3)
    assert cap.err.rstrip().splitlines()[-1] == caps["verdict"] and caps["verdict"].startswith(f"uvaple doctor: exit "
                                                                                                 f"{code}: ")
    if not HAS_CUDA:
        assert caps["uva_usable"] is False and caps["cpu_copy_gbps"] == 1.0


@pytest.mark.extended
def test_doctor_measures_what_runs_here(capsys):
    """Point 2: the measurements themselves (numba's copy gather and the interpreted gather without a GPU; the
    pinned copy and the zero-copy read with one) give figures, and the exit status is the same."""
    code = main(["doctor", "--json", "--seconds", "0.2"])
    caps = json.loads(capsys.readouterr().out)
    assert code == caps["exit_status"] == (0 if HAS_CUDA else 3)
    if HAS_CUDA:
        assert caps["h2d_ceiling_gbps"] > 0 and caps["zero_copy_read_gbps"] > 0
    else:
        assert caps["cpu_copy_gbps"] > 0 and caps["cpu_interpreter_rows_per_s"] > 0


def test_doctor_exit_status_of_each_answer():
    """Point 2: 0 usable; 1 usable capabilities but the measurement failed; 3 no usable GPU (no CUDA, or a GPU
    without the capabilities); a usage error is argparse's 2."""
    from uvaple.commands.doctor import Capabilities, exit_status

    ok = dict(cuda=True, unified_addressing=True, can_map_host_memory=True, host_pointer_for_registered_mem=True)
    assert exit_status(Capabilities(**ok)) == 0
    assert exit_status(Capabilities(**ok, reason="the zero-copy measurement failed: RegistrationError: x")) == 1
    assert exit_status(Capabilities(reason="no CUDA GPU is visible to torch")) == 3
    assert exit_status(Capabilities(**dict(ok, can_map_host_memory=False), reason="the GPU lacks ...")) == 3
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--no-such-flag"])
    assert e.value.code == 2


# -------------------------------------------------------------------------------------------- 3. refusals
@cpu_only
@pytest.mark.parametrize("workload", ["ngram", "hotset", "host"])
def test_a_gpu_workload_without_cuda_is_refused_naming_smoke(capsys, nothing_built, tmp_path, workload):
    """Point 3: ngram, hotset and host time CUDA graphs or GPU launches: without CUDA each is refused before
    anything is built (ngram's 24 GiB table used to end in a HostMemoryError traceback; hotset ran for
    minutes), naming --smoke; --out is not even made."""
    err = _refused(capsys, ["--workload", workload, "--out", str(tmp_path / "out")], "needs a CUDA GPU", "--smoke")
    assert f"uvaple bench --workload {workload}: " in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,names", [
    (["--workload", "ngram", "--table-gib", "2"], ["a 2 GiB table (--table-gib) needs 2.00 GiB", "1.00 GiB",
                                                  "smaller --table-gib", "--smoke"]),
    (["--workload", "hotset"], ["the hotset tables", "--smoke"]),
    (["--workload", "host", "--table-rows", "1000000"], ["--table-rows", "--smoke"]),
    (["--table-gib", "2"], ["a 2GiB table (--table-gib)", "smaller --table-gib"]),
])
def test_a_table_bigger_than_free_host_memory_is_refused_naming_the_flag(capsys, monkeypatch, nothing_built,
                                                                          argv, names):
    """Point 3: a table bigger than free host memory (MemAvailable, here made 1 GiB) is refused before
    anything is built, naming the flag that runs here; as a GPU machine sees it (CUDA is said to be there:
    the refusal comes before any CUDA call)."""
    monkeypatch.setattr(system, "mem_available_bytes", lambda: 1 << 30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _refused(capsys, argv, "needs", "of host memory", *names)


@pytest.mark.parametrize("argv,names", [
    (["--workload", "ngram", "--smoke", "--sweep", "--sort-sweep"], ["--sweep, --sort-sweep time CUDA graphs",
                                                                     "drop --sweep and --sort-sweep or --smoke"]),
    (["--workload", "hotset", "--smoke", "--profile-ids", "p.npy"], ["--profile-ids and --serve-ids go together"]),
    (["--workload", "hotset", "--smoke", "--profile-ids", "/nonexistent/p.npy", "--serve-ids", "/nonexistent/s"],
     ["--profile-ids /nonexistent/p.npy: no readable file"]),
    (["--smoke", "--full"], ["--full (the GPU sweep) and --smoke (the small CPU run) exclude each other"]),
    (["--workload=zipf"], ["--workload must be 'ple'"]),
    (["--workload", "ngram", "--smoke", "--table-gib", "500"], ["--smoke sets its own table", "--table-gib 500 would "
                                                                "be ignored"]),
    (["--workload", "host", "--smoke", "--cols", "64", "--calls", "9"], ["--smoke sets its own sizes; --calls, "
                                                                         "--cols would be ignored"]),
])
def test_what_cannot_run_is_refused_before_any_work(capsys, nothing_built, tmp_path, argv, names):
    """Point 3: GPU-only flags with --smoke (ngram's sweeps used to be skipped without a word), a half-given
    or missing trace (hotset used Zipf draws without a word), --smoke with --full, an unknown workload: exit 2
    before anything is built, and --out untouched."""
    _refused(capsys, [*argv, "--out", str(tmp_path / "out")], *names)
    assert not (tmp_path / "out").exists()


@cpu_only
def test_full_without_cuda_is_refused_naming_what_runs(capsys, nothing_built, tmp_path):
    """Point 3: ``uvaple bench --full`` without CUDA used to run the CPU preset without a word; it is refused,
    saying that plain ``uvaple bench`` (or --smoke) is the CPU run."""
    _refused(capsys, ["--full", "--out", str(tmp_path / "out")], "--full (the GPU sweep) needs a CUDA GPU",
             "--smoke")
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------------------------------------- 4. --out and results
@pytest.mark.parametrize("workload", WORKLOADS)
def test_an_out_that_cannot_be_made_is_refused_before_any_work(capsys, nothing_built, tmp_path, workload):
    """Point 4: an --out that cannot be created (under a file) is refused with its path and the reason before
    any work (it used to fail at the first save, after the work, and lose it)."""
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "results"
    _refused(capsys, ["--workload", workload, "--smoke", "--out", str(bad)], f"--out {bad} cannot be used",
             "Not a directory", "Pass --out with a directory you can write")


def _stub_ple(monkeypatch):
    monkeypatch.setattr(bench, "run_bench", lambda cfg, meta, checkpoint: [])


def _stub_ngram(monkeypatch):
    fake = {"pattern": "random", "n": 8, "bit_exact": {"ours-auto": True}}
    monkeypatch.setattr(ngram, "bench", lambda run, ns, pattern, replays: [dict(fake, pattern=pattern)])


def _stub_hotset(monkeypatch):
    def run(rows, cols, profile, serve, hot_fraction, ns, device, replays, smoke, res):
        res.update(online_rows=1, online_warm_ids=1, online_held_out_hit_rate=0.5, hot_rows=1,
                   held_out_hit_rate=0.5, fp8_error={}, results=[{"n": 8, "bit_exact": {"hot": True}}])
        return res
    monkeypatch.setattr(hotset, "run", run)


def _stub_host(monkeypatch):
    monkeypatch.setattr(host_cost, "run", lambda a, result: result.update(rows={}))


STUBS = {"ple": (_stub_ple, ["--no-plots"], "results.json"), "ngram": (_stub_ngram, [], "ngram.json"),
         "hotset": (_stub_hotset, [], "hotset.json"), "host": (_stub_host, [], "host_cost.json"),
         # disk's run is real, cut to one depth and one row count and no decode steps (the whole smoke run is
         # test_disk_bench.py's): this test is of where the results go
         "disk": (lambda monkeypatch: None, ["--no-steps", "--depths", "1", "--rows", "1", "--read-depths", "8",
                                             "--file-gib", "0.01"], "disk.json")}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_smoke_run_writes_its_results_by_default_and_says_where_last(capsys, monkeypatch, tmp_path, workload):
    """Point 4: a --smoke run without --out writes its JSON under ./uvaple-results/<time>_<workload>_cpu/ (it
    used to write nothing, without a word), and its last line names the directory and the files."""
    stub, extra, name = STUBS[workload]
    stub(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--workload", workload, "--smoke", "--quiet", *extra]) == 0
    [out] = (tmp_path / "uvaple-results").iterdir()
    assert out.name.endswith(f"_{workload}_cpu") and json.loads((out / name).read_text())
    said = capsys.readouterr()
    last = said.out.rstrip().splitlines()[-1]
    assert last.startswith(f"results in {out}/ (") and name in last
    if workload == "ple":  # the columns are explained under the table, and why a CPU run's ratios are no bound
        assert "xceil GB/s over memcpy-ceiling's" in said.out and "g_xceil" in said.out
        assert "a provider above 1.00 xceil here breaks no bound" in said.out
        assert "xceil GB/s over memcpy-ceiling's" in (out / "summary.txt").read_text()
    if workload == "host":
        assert "the times below are the interpreter's" in said.out + said.err


def test_a_hotset_point_is_a_line_a_person_reads():
    rec = {"n": 64, "kind": "decode", "distinct": 51.2, "hit_rate": 0.81234, "online_hit_rate": 0.9,
           "bit_exact": {"hot": True, "dedup": False, "peer": True}}
    line = hotset.point_line(rec)
    assert line == ("n=64 (decode, 51 distinct): hot set hit rate 0.812, online 0.900; DIFFERED: dedup")
    rec["bit_exact"]["dedup"] = True
    rec.update(us={"uncached": 10.0, "hot": 4.0, "all": 2.5, "peer": 12.5, "sort": 3.0}, all_over_peer=5.0)
    assert hotset.point_line(rec).endswith("all 3 checks exact; us uncached 10.0, hot 4.0, all 2.5, peer 12.5; "
                                           "peer / all 5.00")


@pytest.mark.parametrize("workload", ["ngram", "hotset", "host"])
def test_a_failed_run_keeps_what_it_measured_and_says_where(capsys, monkeypatch, tmp_path, workload):
    """Point 4: a run that fails part way writes what it measured (with the error) before the error
    propagates, and says where on stderr."""
    def failing(*args):
        if args and isinstance(args[-1], dict):  # hotset's and host's run() fill the dict they are given
            args[-1]["measured"] = "before the failure"
        raise RuntimeError("planted failure")

    if workload == "ngram":
        monkeypatch.setattr(ngram, "bench", lambda *a: failing())
    else:
        monkeypatch.setattr({"hotset": hotset, "host": host_cost}[workload], "run", failing)
    with pytest.raises(RuntimeError, match="planted failure"):
        main(["bench", "--workload", workload, "--smoke", "--quiet", "--out", str(tmp_path)])
    [path] = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["error"] == "RuntimeError: planted failure"
    assert workload == "ngram" or doc["measured"] == "before the failure"
    assert f"what it measured is in {path}" in capsys.readouterr().err


def test_a_failed_ple_run_says_where_its_finished_tables_are(capsys, monkeypatch, tmp_path):
    """Point 4: the ple sweep saves after every table; a run that fails after one says where those are."""
    def run_bench(cfg, meta, checkpoint):
        checkpoint([])  # a table finished
        raise RuntimeError("planted failure")

    monkeypatch.setattr(bench, "run_bench", run_bench)
    with pytest.raises(RuntimeError, match="planted failure"):
        main(["bench", "--smoke", "--quiet", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["partial"] is True
    assert f"the tables it finished are in {tmp_path}/" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------- 5. progress
def test_bars_go_to_stderr_with_a_count_and_quiet_silences_them(capsys, monkeypatch):
    """Point 5: progress is a tqdm bar on stderr (stdout keeps the results), with a count; --quiet (the
    ``progress(False)`` context every workload's main enters) shows none."""
    monkeypatch.setattr(command, "BAR_DELAY_S", 0.0)
    for _ in command.bar(range(3), desc="points"):
        command.say("a result")
    cap = capsys.readouterr()
    assert cap.out == "a result\n" * 3
    assert "points" in cap.err and "3/3" in cap.err
    with command.progress(False):
        for _ in command.bar(range(3), desc="points"):
            pass
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("fill", [
    lambda: hotset.normal_table(64, 512, seed=1),
    lambda: vllm_shapes.random_table(2048, 160, torch.uint8, seed=1),
])
def test_table_fills_show_progress(capsys, monkeypatch, fill):
    """Point 5: filling a benchmark table (hotset's E4B table, ngram's fp8 table: seconds to minutes at their
    real sizes) shows a bar counting its blocks."""
    monkeypatch.setattr(command, "BAR_DELAY_S", 0.0)
    fill().close()
    err = capsys.readouterr().err
    assert "filling the table" in err and "1/1" in err


def test_the_ple_sweep_shows_its_points(capsys, monkeypatch):
    """Point 5: the ple sweep's bar counts its points and says which runs now."""
    from uvaple.perf.progress import Progress

    monkeypatch.setattr(command, "BAR_DELAY_S", 0.0)
    p = Progress(2)
    p.note("E4B 4MiB: creating and filling the table")
    p.step("E4B 4MiB n=1 uva")
    p.step("E4B 4MiB n=1 copy")
    p.close()
    err = capsys.readouterr().err
    assert "creating and filling the table" in err and "2/2" in err and "n=1 copy" in err


def test_quiet_reaches_the_workloads_bars(capsys, monkeypatch, tmp_path):
    """Point 5: a workload's --quiet turns off the bars made inside its run (here host's)."""
    monkeypatch.setattr(command, "BAR_DELAY_S", 0.0)

    def run(a, result):
        for _ in command.bar(range(2), desc="ids per call"):
            pass
        result.update(rows={})

    monkeypatch.setattr(host_cost, "run", run)
    assert main(["bench", "--workload", "host", "--smoke", "--out", str(tmp_path)]) == 0
    assert "ids per call" in capsys.readouterr().err
    assert main(["bench", "--workload", "host", "--smoke", "--quiet", "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


# -------------------------------------------------------------------------------------------- 6. shm list
def test_shm_list_shows_the_tables_bytes_and_the_mapped_size(capsys):
    """Point 6: a 3 KiB table (3 rows of 1,024 bytes) shows as 3.00 KiB (rows x row stride), its file's
    2 MiB + 4 KiB in a second column (it used to show 2.00 MiB as the size)."""
    name = f"test-cli-{uuid.uuid4().hex[:12]}"
    with HostTable.shared(name, 3, 1024, torch.uint8, fill=lambda t: t.write_rows(torch.ones(3, 1024,
                                                                                            dtype=torch.uint8))):
        assert main(["shm", "list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:3] == ["name", "table", "mapped"]
        [line] = [ln for ln in lines if ln.startswith(name)]
        assert line.split()[1:5] == ["3.00", "KiB", "2.00", "MiB"]
        assert main(["shm", "list", "--json"]) == 0
        [info] = [i for i in json.loads(capsys.readouterr().out) if i["name"] == name]
        assert info["table_bytes"] == 3 * 1024 and info["stride_bytes"] == 1024
        assert info["size_bytes"] == (2 << 20) + 4096


# -------------------------------------------------------------------------------------------- bad values, named
@pytest.mark.parametrize("argv,said", [
    (["bench", "--row-bytes", "x"], "argument --row-bytes: expected row sizes in bytes (17920, 128k) or e2b"),
    (["bench", "--rows", "1,x"], "argument --rows: expected comma-separated positive integers, got '1,x'"),
    (["bench", "--table-gib", "a"], "argument --table-gib: expected sizes in GiB above 0"),
    (["bench", "--point-time", "-1"], "argument --point-time: expected a number above 0 (seconds), got '-1'"),
    (["bench", "--time-budget", "-5"], "argument --time-budget: expected a number at least 0 (seconds; 0: no limit)"),
    (["bench", "--host-mem-gib", "-3"], "argument --host-mem-gib: expected a number above 0 (GiB), got '-3'"),
    (["bench", "--workload", "ngram", "--table-gib", "nan"], "argument --table-gib: expected a number above 0 (GiB)"),
    (["bench", "--workload", "host", "--cols", "0"], "argument --cols: expected a number above 0 (a count), got '0'"),
    (["bench", "--workload", "hotset", "--replays", "0"], "argument --replays: expected a number above 0"),
    (["doctor", "--seconds", "-1"], "argument --seconds: expected a number of seconds above 0, got '-1'"),
    (["doctor", "--seconds", "inf"], "argument --seconds: expected a number of seconds above 0, got 'inf'"),
    (["bench", "--point-time", "inf"], "argument --point-time: expected a number above 0 (seconds), got 'inf'"),
    (["shm"], "say what to do: 'uvaple shm list' shows the shared tables"),
])
def test_a_bad_value_is_named_with_what_was_typed_and_what_is_accepted(capsys, argv, said):
    """argparse's internals never reach the user (``invalid _parse_row_bytes value``, ``the following arguments
    are required: cmd``), and a value the command cannot honour is refused, not run or ignored."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err, err
    assert "invalid" not in err and "_parse" not in err and "required: cmd" not in err


def test_every_workloads_help_gives_the_exit_status_of_a_failed_provider(capsys):
    for argv in (["bench"], ["bench", "--workload", "ngram"], ["bench", "--workload", "hotset"],
                 ["bench", "--workload", "host"]):
        out = " ".join(_help(capsys, [*argv, "--help"]).split())
        assert "2 refused before any work" in out and "3 a provider or a point failed" in out, argv


def test_doctor_says_what_it_checks_before_it_waits(capsys):
    from uvaple.commands import doctor

    said = []
    doctor.capabilities(measure=False, say=said.append)
    assert said and "checking torch and CUDA" in said[0]
    if not torch.cuda.is_available():
        said.clear()
        doctor.capabilities(measure=True, seconds=0.2, say=said.append)
        assert any("timing the copy placement and the interpreted gather" in m for m in said)


def test_a_shared_table_directory_that_is_not_a_tmpfs_is_refused_without_hiding_it(tmp_path):
    from uvaple.uva import segments

    if system.filesystem_type(str(tmp_path)) == segments.TMPFS_MAGIC:
        pytest.skip("this machine's temporary directory is a tmpfs")
    with pytest.raises(segments.SharedSegmentError) as e:
        segments.segment_dir(tmp_path)
    msg = str(e.value)
    assert "a mount hides what" in msg and "new empty directory" in msg and f"none {tmp_path}" not in msg
