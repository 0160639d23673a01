"""``uvaple bench --workload disk`` on this machine: a real table file, real random reads (``O_DIRECT`` where the
filesystem allows it), the reference reader's rows checked against what was written; bad options and files
refused before any work."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from uvaple.commands.cli import main
from uvaple.perf import disk
from uvaple.uva.table_file import write_table_file


def run(capsys, args: list[str]) -> tuple[int, str, str]:
    """``uvaple bench --workload disk ARGS``: the exit status (argparse's refusals exit, as in every
    workload), stdout, stderr."""
    try:
        code = main(["bench", "--workload", "disk", "--quiet", *args])
    except SystemExit as e:
        code = e.code
    said = capsys.readouterr()
    return code, said.out, said.err


def test_a_smoke_run_reads_at_every_depth_and_the_reader_is_exact(capsys, tmp_path):
    code, out, _ = run(capsys, ["--smoke", "--depths", "1,4", "--rows", "1,300", "--read-depths", "3",
                                "--layers", "2", "--dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert code == 0
    res = json.loads((tmp_path / "out" / "disk.json").read_text())
    assert [r["depth"] for r in res["probe"]] == [1, 4]
    assert all(r["reads"] > 0 and r["reads_per_s"] > 0 and r["latency_us_p99"] >= r["latency_us_median"] > 0
               for r in res["probe"])
    ur = res["uring"]  # io_uring from one thread, where the kernel allows it: its rates count toward the limit
    engines = [("threads", 3)] + ([("uring", 3)] if "rate" in ur else [])
    assert [(r["engine"], r["depth"], r["rows_per_call"]) for r in res["reader"]] == \
        [(None, None, 1), (None, None, 300)] + [(e, d, n) for e, d in engines for n in (1, 300)]
    assert all(r["call_us_median"] > 0 for r in res["reader"])
    assert all(r["bit_exact"] is True and r["calls"] >= 1 and r["x_limit"] > 0 for r in res["reader"]), res["reader"]
    assert res["file"]["rows"] % 23 == 0 and res["file"]["row_bytes"] == 164
    assert res["limit_reads_per_s"] == max(r["reads_per_s"] for r in res["probe"] + (res["fio"] or [])
                                           + ur.get("rate", []) if "error" not in r)
    if "error" in ur:
        assert f"io_uring: not run ({ur['error']})" in out
    else:
        assert [r["depth"] for r in ur["rate"]] == [1, 4] and all(r["reads_per_s"] > 0 for r in ur["rate"])
        assert "batched reader, io_uring, depth   3,   300 rows a call:" in out
    assert "probe depth   4:" in out and "reference reader,   300 rows a call:" in out
    assert "batched reader,  threads, depth   3,   300 rows a call:" in out
    steps = res["steps"]  # the disk placement's decode steps, small and interpreted: every provider's rows exact
    assert set(steps["batches"]) == {"1", "3"} and steps["tokens"] >= 1000
    for batch in steps["batches"].values():
        assert set(batch) == {"pinned", "disk 0.25", "disk 0.25 hot 0.01", "mmap", "disk 0.25 x2 layer by layer",
                              "disk 0.25 x2 round"} | ({"disk 0.25 threads"} if "rate" in ur else set())
        assert all(r["exact"] for r in batch.values())
        alone, together = batch["disk 0.25 x2 layer by layer"], batch["disk 0.25 x2 round"]
        # two layers' steps read as a model reads them: the same pages and hits in one round as layer by layer
        assert together["pages_per_step"] == alone["pages_per_step"] > batch["disk 0.25"]["pages_per_step"]
        assert together["hit_rate"] == alone["hit_rate"] and together["x_layer_by_layer"] > 0
        parts = together["parts_median_us"]  # the round's own parts, each a share of the step
        assert {"ids", "read_ahead", "read_ahead_longest", "read_ahead_sum", "calls"} <= set(parts), parts
        assert 0 < parts["read_ahead_longest"] <= parts["read_ahead"] <= parts["call"], parts
        assert parts["read_ahead_longest"] <= parts["read_ahead_sum"] and parts["calls"] > 0, parts
        disk, hot = batch["disk 0.25"], batch["disk 0.25 hot 0.01"]
        assert 0 <= disk["hit_rate"] <= 1 and disk["pages_per_step"] > 0 and disk["io_floor_us"] > 0
        assert "hot_hit_rate" not in disk and 0 <= hot["hot_hit_rate"] <= 1
        for name, r in batch.items():  # where a step goes: the call, then the wait for its rows
            parts = r["parts_median_us"]
            assert parts["call"] > 0 and parts["sync"] >= 0, (name, parts)
            # a disk provider's call's parts, each a share of it (medians of the same steps)
            if name.startswith("disk") and " x2 " not in name:
                assert set(parts) == {"call", "sync", "read_in", "pages", "gather", "plan_copy", "rest"}
                assert parts["read_in"] > 0 and parts["gather"] > 0 and parts["plan_copy"] > 0, (name, parts)
                assert 0 <= parts["pages"] <= parts["read_in"] <= parts["call"], (name, parts)
                assert parts["rest"] > 0, (name, parts)
    assert "batch   3  disk 0.25: steady" in out and "of ids from the hot rows" in out
    assert "disk 0.25 x2 round: steady" in out and "x the time of layer by layer" in out
    assert "    parts (median us): call " in out and ", read_in " in out
    assert os.listdir(tmp_path) == ["out"]  # the file it wrote is gone (no --keep)
    if not res["file"]["direct"]:
        assert "O_DIRECT is refused on this filesystem" in out


def test_an_existing_table_file_is_read_as_it_is(capsys, tmp_path):
    src = torch.randint(0, 256, (500, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    write_table_file(tmp_path / "t.uvt", src)
    code, _, _ = run(capsys, ["--file", str(tmp_path / "t.uvt"), "--seconds", "0.05", "--depths", "2",
                              "--rows", "7", "--read-depths", "2", "--out", str(tmp_path / "out")])
    assert code == 0
    res = json.loads((tmp_path / "out" / "disk.json").read_text())
    assert res["file"]["rows"] == 500 and res["reader"][0]["bit_exact"] is None  # nothing to compare with
    assert (tmp_path / "t.uvt").exists()  # a file it did not write is left alone


@pytest.mark.parametrize("args,says", [
    (["--depths", "300"], ["--depths 300: at most 256"]),
    (["--layers", "0"], ["--layers", "above 0 (PLE layers read a step)"]),
    (["--depths", "0"], ["--depths", "expected comma-separated positive integers"]),
    (["--seconds", "-1"], ["--seconds", "above 0"]),
    (["--file", "/nonexistent/t.uvt"], ["--file /nonexistent/t.uvt: no such file"]),
    (["--file", "t.uvt", "--file-gib", "8"], ["--file t.uvt with --file-gib: --file reads an existing table file",
                                              "--file-gib shapes a file this run writes; drop one"]),
    (["--file", "t.uvt", "--dir", "/tmp", "--keep"], ["--file t.uvt with --dir --keep", "--dir and --keep shape"]),
])
def test_bad_options_are_refused_before_any_work(capsys, tmp_path, args, says):
    code, _, err = run(capsys, [*args, "--out", str(tmp_path / "out")])
    assert code == 2 and all(s in err for s in says), err


def test_a_file_that_is_not_a_table_file_or_does_not_fit_is_refused(capsys, tmp_path, monkeypatch):
    (tmp_path / "junk").write_bytes(os.urandom(9000))
    code, _, err = run(capsys, ["--file", str(tmp_path / "junk"), "--out", str(tmp_path / "out")])
    assert code == 2 and f"--file {tmp_path / 'junk'}:" in err and "nothing was run" in err
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 30))
    code, _, err = run(capsys, ["--file-gib", "4", "--dir", str(tmp_path), "--out", str(tmp_path / "out2")])
    assert code == 2 and "--file-gib 4: 4.00 GiB does not fit the 1.00 GiB free" in err
    assert sorted(os.listdir(tmp_path)) == ["junk", "out", "out2"]  # no directory left for the file


@pytest.mark.parametrize("batch", [1, 2, 8, 64])
def test_the_hot_sets_profile_reads_text_the_run_never_reads(batch):
    """The profile's lanes start where the run's lanes of the same number stop: no (lane, token) of the run is in
    the profile, at even batches too (a profile half the text away is the run's own lanes there)."""
    from uvaple.perf import command, disk_steps

    steps, tokens = 40, np.arange(64 * 2 * 42 + 5, dtype=np.int64)  # every token distinct: windows by value
    run_ = disk_steps.Steps(tokens, 10_000, batch, steps)
    profile = disk_steps.Steps(tokens, 10_000, batch, steps, skip=steps + disk_steps.NGRAM - 1)
    assert not set(run_.history.reshape(-1).tolist()) & set(profile.history.reshape(-1).tolist())
    assert profile.history.shape == run_.history.shape
    hot = disk_steps.hot_rows(tokens, 10_000, batch, steps, 0.01)
    ids = torch.cat([profile.ids(s).reshape(-1) for s in range(steps)])
    counts = torch.bincount(ids, minlength=10_000)
    assert hot.numel() == 100 and hot.unique().numel() == 100
    assert counts[hot].min() >= counts.sort(descending=True).values[99]  # the profile's most read rows
    assert torch.equal(hot, torch.argsort(counts, descending=True, stable=True)[:100])
    with pytest.raises(command.Refused, match=f"--hot at batch {batch * 8}: .* give more --text, fewer --steps"):
        disk_steps.hot_rows(tokens[: 2 * 42 * batch * 8 - 1], 10_000, batch * 8, steps, 0.01)


def test_a_timed_disk_provider_is_freed_when_closed(tmp_path):
    """The step timers wrap the lookup's own methods on its instances; closing the provider takes them off, so
    the lookup, its cache and its reader go when the provider does (no cycle left to the collector)."""
    import gc
    import weakref

    from uvaple.perf.disk_steps import Disk

    src = torch.randint(0, 256, (300, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    write_table_file(tmp_path / "t.uvt", src)
    d = Disk(str(tmp_path / "t.uvt"), torch.device("cpu"), 0.5, 16)
    rows = d(torch.arange(16, dtype=torch.int64))
    assert torch.equal(rows.view(torch.uint8).reshape(16, -1)[:, :40], src[:16])
    assert all(len(v) == 1 for v in d.phases.values()) and d.phases["read_in"][0] > 0
    refs = [weakref.ref(x) for x in (d.lookup, d.lookup.cache, d.lookup._reader)]
    gc.disable()  # what frees them must be the reference counts, not the collector
    try:
        d.close()
        del d
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
