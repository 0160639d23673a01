"""The vLLM plugin's ``disk`` placement without vLLM: its settings, the staging file vLLM's loader writes, the
table file written from it (or reused), and the disk lookup over it (its engine runs are in perf/vllm_carry)."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from helpers import bits, rand

from uvaple.integration import TableSpec
from uvaple.integration.models.vllm._build import shard_table
from uvaple.integration.models.vllm.config import PluginConfig, PluginConfigError, check_engine, from_sources
from uvaple.integration.models.vllm.disk_shard import DiskShard
from uvaple.integration.models.vllm.tables import PluginLoadError
from uvaple.uva import TableFile

CPU = torch.device("cpu")


def cfg_in(folder, **kw) -> PluginConfig:
    return PluginConfig(placement="disk", disk_dir=str(folder), metrics_interval_s=0, **kw)


def disk_shard(cfg: PluginConfig, *, identity="d" * 64, loaded=90, cols=40, dtype=torch.bfloat16, **kw) -> DiskShard:
    s = shard_table(cfg, layer="m.layers.0.ple", rows=96, cols=cols, dtype=dtype, loaded_rows=loaded, rank=1,
                    size=2, identity=identity, device=CPU, **kw)
    assert isinstance(s, DiskShard)
    return s


def loaded(s: DiskShard, w: torch.Tensor) -> DiskShard:
    """``w`` written as vLLM's loader hands a checkpoint over (in pieces), then finished."""
    for a, b in ((0, 37), (37, 64), (64, w.shape[0])):
        s.write(w[a:b], a)
    s.finish()
    return s


# ------------------------------------------------------------------ settings
def test_the_disk_settings(tmp_path):
    got = from_sources({"uvaple": {"placement": "disk", "disk_dir": str(tmp_path / "t"), "disk_cache_gb": 0.5}}, {})
    assert got == PluginConfig(placement="disk", disk_dir=str(tmp_path / "t"), disk_cache_gb=0.5)
    env = {"UVAPLE_PLACEMENT": "disk", "UVAPLE_DISK_DIR": f" {tmp_path} ", "UVAPLE_DISK_CACHE_GB": "2"}
    assert from_sources(None, env) == PluginConfig(placement="disk", disk_dir=str(tmp_path), disk_cache_gb=2.0)


@pytest.mark.parametrize("entry,match", [
    ({"placement": "disk"}, "placement 'disk' needs disk_dir: a folder on a local disk.*UVAPLE_DISK_DIR"),
    ({"disk_dir": "/tmp/x"}, "disk_dir: settings of the placement that serves table files \\(\\['disk'\\]\\), not of "
                             "placement 'uva'"),
    ({"placement": "device", "disk_cache_gb": 1}, "disk_cache_gb: settings of the placement .*not of placement "
                                                  "'device'"),
    ({"placement": "disk", "disk_dir": ""}, "disk_dir: expected a folder on a local disk"),
    ({"placement": "disk", "disk_dir": 3}, "disk_dir: expected a folder"),
    ({"placement": "disk", "disk_dir": "/tmp/x", "disk_cache_gb": 0}, "disk_cache_gb: expected a positive number"),
    ({"placement": "disk", "disk_dir": "/tmp/x", "disk_cache_gb": "big"}, "disk_cache_gb: expected a positive"),
    ({"placement": "disk", "disk_dir": "/tmp/x", "disk_cache_gb": True}, "disk_cache_gb: expected a positive"),
    ({"placement": "disk", "disk_dir": "/tmp/x", "fallback": "copy"}, "fallback 'copy': the disk placement needs "
                                                                      "no fallback"),
    ({"placement": "disk", "disk_dir": "/tmp/x", "hot_cache_gb": 1, "hot_profile": __file__},
     "hot_cache_gb: a hot set stands in front of rows in host memory"),
])
def test_bad_disk_settings_are_named(entry, match):
    with pytest.raises(PluginConfigError, match=match):
        from_sources({"uvaple": entry}, {})


def test_the_disk_placement_is_refused_under_cuda_graphs_and_served_eager(tmp_path):
    cfg = cfg_in(tmp_path)
    with pytest.raises(PluginConfigError, match="placement 'disk' cannot run inside vLLM's CUDA graphs .a disk call "
                                                "plans its rows on the host.*enforce_eager=True"):
        check_engine(cfg, cuda_graphs=True)
    check_engine(cfg, cuda_graphs=False)


def test_a_disk_dir_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(PluginConfigError, match="disk_dir: cannot make the folder .*file/t"):
        disk_shard(cfg_in(tmp_path / "file" / "t"))


# ------------------------------------------------------------------ the shard
def test_a_disk_shard_is_staged_written_to_its_file_and_read(tmp_path):
    """The loader's rows (cast as vLLM's copy_ casts) go to the staging file, whose name is gone at once; the table
    file is written at the lookup, named by the model, layer and rank, and its rows come back exact, ids outside
    the shard's window as zero rows. A checkpoint that leaves rows unwritten is named."""
    s = disk_shard(cfg_in(tmp_path))
    assert os.listdir(tmp_path) == []  # the staging file's name is removed once mapped
    assert s.tensor.shape == (96, 40) and s.tensor.dtype == torch.bfloat16  # the parameter vLLM's loader writes
    w = rand(90, 40, torch.float32, seed=1)
    s.write(w[:50], 0)
    with pytest.raises(PluginLoadError, match="left 40 of 90 rows"):
        s.finish()
    s.write(w[40:], 40)
    s.finish()
    s.finish()  # idempotent
    want = w.to(torch.bfloat16)
    assert torch.equal(bits(s.tensor[:90]), bits(want))
    lk = s.lookup(TableSpec.of(s.table, row_window=(0, 90), id_offset=96), max_rows=16)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(s.path)] and s.path.endswith(".r1of2.uvt")
    ids = torch.tensor([96, 96 + 89, 96 + 5, 0, 95, 96 + 90, 10**6])
    out = torch.full((7, 40), float("nan"), dtype=torch.bfloat16)
    lk.lookup(ids, out)
    assert torch.equal(bits(out[:3]), bits(want[[0, 89, 5]]))
    assert torch.equal(bits(out[3:]), bits(torch.zeros(4, 40, dtype=torch.bfloat16)))
    with TableFile.open(s.path) as f:
        assert lk.stats()["lookups"] == 1 and f.source.startswith("vllm " + "d" * 64)
    lk.close()
    s.close()


def test_a_later_engine_of_the_same_checkpoint_reuses_the_file_and_another_writes_its_own(tmp_path):
    """A complete file of the same identity, layer, rank and encoding is reused: the loader's rows are checked, not
    staged, and the lookup reads the file as written. Another checkpoint's identity writes a file of its own."""
    w = rand(90, 40, torch.bfloat16, seed=2)
    first = loaded(disk_shard(cfg_in(tmp_path)), w)
    first.lookup(TableSpec.of(first.table), max_rows=8).close()
    first.close()
    again = disk_shard(cfg_in(tmp_path))
    assert again.file is not None and not again.fills
    with pytest.raises(PluginLoadError, match="do not fit"):
        again.write(torch.zeros(3, 41), 0)  # shapes are still checked
    loaded(again, w)  # the loader's rows: compared with the file's, not staged
    assert int(again.table.tensor.view(torch.int16).count_nonzero()) == 0  # nothing staged
    other = rand(90, 40, torch.bfloat16, seed=3)
    ids = torch.arange(90)
    lk = again.lookup(TableSpec.of(again.table), max_rows=90)
    assert torch.equal(bits(lk.lookup(ids)), bits(w))
    lk.close()
    again.close()
    changed = loaded(disk_shard(cfg_in(tmp_path), identity="e" * 64), other)
    lk = changed.lookup(TableSpec.of(changed.table), max_rows=90)
    assert torch.equal(bits(lk.lookup(ids)), bits(other)) and changed.path != again.path
    lk.close()
    changed.close()


def test_a_reused_file_still_needs_the_whole_checkpoint(tmp_path):
    w = rand(90, 40, torch.bfloat16, seed=4)
    s = loaded(disk_shard(cfg_in(tmp_path)), w)
    s.lookup(TableSpec.of(s.table), max_rows=8).close()
    s.close()
    again = disk_shard(cfg_in(tmp_path))
    again.write(w[:60], 0)
    with pytest.raises(PluginLoadError, match="left 30 of 90 rows"):
        again.finish()
    again.close()


def test_dummy_weights_are_written_at_every_start(tmp_path):
    w, v = rand(96, 40, torch.bfloat16, seed=5), rand(96, 40, torch.bfloat16, seed=6)
    for rows in (w, v):
        s = disk_shard(cfg_in(tmp_path), check_loaded=False)
        assert s.fills
        s.tensor.copy_(rows)  # vLLM's dummy fill writes the parameter
        s.finish()
        lk = s.lookup(TableSpec.of(s.table), max_rows=96)
        assert torch.equal(bits(lk.lookup(torch.arange(90))), bits(rows[:90]))
        lk.close()
        s.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_fp8_row_disk_shard_serves_the_host_shards_bits(tmp_path, dtype):
    """quantize fp8_row with the disk placement: the staging holds the encoding's bytes as a host shard does, and
    the file's lookup returns the registry's reference rows, bit for bit."""
    from uvaple.kernels.encodings import ENCODINGS, quantize_fp8_rows

    s = disk_shard(cfg_in(tmp_path), cols=37, dtype=dtype, encoding="fp8_row")
    assert s.tensor.shape == (96, 37) and s.tensor.dtype == torch.float8_e4m3fn
    w = rand(90, 37, dtype, seed=7)
    loaded(s, w)
    want = quantize_fp8_rows(w)
    lk = s.lookup(TableSpec.of(s.table, encoding="fp8_row", out_dtype=torch.bfloat16), max_rows=16, token_ids=False)
    ids = torch.tensor([0, 89, 3, 17, 17, 95])
    got = lk.lookup(ids)
    assert torch.equal(bits(got[:5]), bits(ENCODINGS["fp8_row"].dequantise(want[ids[:5]], torch.bfloat16)))
    assert torch.equal(bits(got[5:]), bits(torch.zeros(1, 37, dtype=torch.bfloat16)))
    with TableFile.open(s.path) as f:
        assert f.encoding == "fp8_row"
    lk.close()
    s.close()


def test_a_row_cache_too_small_and_a_lookup_of_another_encoding_are_named(tmp_path):
    s = loaded(disk_shard(cfg_in(tmp_path, disk_cache_gb=1e-6)), rand(90, 40, torch.bfloat16, seed=8))
    with pytest.raises(PluginConfigError, match="disk_cache_gb=1e-06 for m.layers.0.ple: a step of vLLM's may bring "
                                                "64 distinct rows of 80 B.*give disk_cache_gb >= 5.12e-06"):
        s.lookup(TableSpec.of(s.table), max_rows=64)
    with pytest.raises(PluginLoadError, match="reads fp8_global rows; the table file holds raw"):
        s.lookup(TableSpec(96, 40, torch.float8_e4m3fn, encoding="fp8_global", out_dtype=torch.bfloat16),
                 max_rows=4)
    s.close()


def test_a_staging_file_left_by_a_killed_process_is_removed(tmp_path):
    pid = subprocess.Popen(["true"])  # a process that has ended
    pid.wait()
    s = disk_shard(cfg_in(tmp_path))
    left = f"{s.path}.loading.{pid.pid}"
    open(left, "wb").close()
    s.close()
    disk_shard(cfg_in(tmp_path)).close()
    assert not os.path.exists(left)


def test_a_disk_too_full_for_the_staging_file_is_named_at_once_and_a_reused_file_stages_nothing(tmp_path,
                                                                                              monkeypatch):
    """The staging file's blocks are reserved when it is made: a full disk is a named error before the loader
    writes (a write into a hole of a full disk would be a SIGBUS). A reused file reserves nothing."""
    import errno

    w = rand(90, 40, torch.bfloat16, seed=9)
    s = loaded(disk_shard(cfg_in(tmp_path)), w)
    s.lookup(TableSpec.of(s.table), max_rows=8).close()
    s.close()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    again = loaded(disk_shard(cfg_in(tmp_path)), w)  # reused: nothing reserved
    lk = again.lookup(TableSpec.of(again.table), max_rows=90)
    assert torch.equal(bits(lk.lookup(torch.arange(90))), bits(w))
    lk.close()
    again.close()
    with pytest.raises(PluginLoadError, match="m.layers.0.ple: the staging file of 7.50 KiB does not fit in .*No space "
                                              "left on device.*free about twice that.*or give another disk_dir"):
        disk_shard(cfg_in(tmp_path), identity="f" * 64)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(s.path)]  # nothing left of the refused one


def test_a_reused_file_of_other_weights_under_the_same_identity_is_never_served(tmp_path):
    """A hub model without a revision keeps its identity when its weights change: each block the loader hands over is
    compared (its first row) with the file. At the first block the shard stages the checkpoint after all and writes
    the file again; a later block that differs is a named error, and the file is removed for the next start."""
    w, v = rand(90, 40, torch.bfloat16, seed=10), rand(90, 40, torch.bfloat16, seed=11)
    s = loaded(disk_shard(cfg_in(tmp_path)), w)
    s.lookup(TableSpec.of(s.table), max_rows=8).close()
    s.close()
    changed = loaded(disk_shard(cfg_in(tmp_path)), v)  # differs from its first block on
    assert changed.fills
    lk = changed.lookup(TableSpec.of(changed.table), max_rows=90)
    assert torch.equal(bits(lk.lookup(torch.arange(90))), bits(v))
    lk.close()
    changed.close()
    late = disk_shard(cfg_in(tmp_path))
    mixed = v.clone()
    mixed[37:] = w[37:]  # the same first block, then other rows
    late.write(mixed[:37], 0)
    with pytest.raises(PluginLoadError, match="holds rows other than this checkpoint's at row 37.*name a revision.*it "
                                              "is removed: start the engine again"):
        late.write(mixed[37:], 37)
    assert not os.path.exists(late.path)
    late.close()
    again = loaded(disk_shard(cfg_in(tmp_path)), mixed)  # the next start writes it
    lk = again.lookup(TableSpec.of(again.table), max_rows=90)
    assert torch.equal(bits(lk.lookup(torch.arange(90))), bits(mixed))
    lk.close()
    again.close()


def test_an_fp8_row_file_is_reused_and_checked_in_its_encoding(tmp_path):
    w = rand(90, 37, torch.bfloat16, seed=12)
    for n in range(2):
        s = loaded(disk_shard(cfg_in(tmp_path), cols=37, encoding="fp8_row"), w)
        assert s.fills == (n == 0)  # the quantised first rows match the file's: reused
        lk = s.lookup(TableSpec.of(s.table, encoding="fp8_row", out_dtype=torch.bfloat16), max_rows=8, token_ids=False)
        lk.close()
        s.close()


def test_an_fp8_checkpoint_is_served_with_its_global_scale(tmp_path):
    """An fp8 checkpoint's codes are stored as they are (fp8_global) and dequantised with the scale parameter."""
    from uvaple.kernels.encodings import ENCODINGS

    codes = rand(90, 40, torch.bfloat16, seed=13).to(torch.float8_e4m3fn)
    s = loaded(disk_shard(cfg_in(tmp_path), dtype=torch.float8_e4m3fn), codes)
    assert s.file_encoding == "fp8_global"
    scale = torch.tensor([0.037], dtype=torch.float32)
    lk = s.lookup(TableSpec.of(s.table, encoding="fp8_global", out_dtype=torch.bfloat16), max_rows=8,
                  dequant_scale=scale, token_ids=False)
    ids = torch.tensor([0, 89, 5])
    want = ENCODINGS["fp8_global"].dequantise(codes[ids], torch.bfloat16, scale)
    assert torch.equal(bits(lk.lookup(ids)), bits(want))
    lk.close()
    s.close()
