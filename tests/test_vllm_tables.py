"""The vLLM plugin's settings and shard tables, without vLLM (its model tests are in tests_vllm/)."""

from __future__ import annotations

import logging
import math
import os
import uuid

import numpy as np
import pytest
import torch
from helpers import bits, rand

from uvaple.integration.models.vllm.config import PluginConfig, PluginConfigError, from_sources
from uvaple.integration.models.vllm.tables import (
    PluginLoadError,
    ShardTable,
    UvaUnavailable,
    model_identity,
    segment_name,
)
from uvaple.uva import SharedSegmentError, SharedSegmentTimeout
from uvaple.uva.errors import DeviceCapabilityError, RegistrationError

CPU = torch.device("cpu")


# ------------------------------------------------------------------ settings
def test_the_plugin_is_enabled_only_when_asked():
    assert from_sources(None, {}) is None
    assert from_sources({"other": {"x": 1}}, {"PATH": "/bin"}) is None
    assert from_sources({"uvaple": {}}, {}) == PluginConfig()
    assert from_sources(None, {"UVAPLE_SHARED": "no"}) == PluginConfig(shared=False)
    got = from_sources({"uvaple": {"placement": "COPY", "timeout_s": 5}}, {"UVAPLE_PLACEMENT": "device",
                                                                          "UVAPLE_SEGMENT": "node-a"})
    assert got == PluginConfig(placement="copy", segment="node-a", timeout_s=5.0)  # the additional config wins


def test_metrics_interval_setting():
    assert PluginConfig().metrics_interval_s == 5.0
    assert from_sources(None, {"UVAPLE_METRICS_INTERVAL_S": "0"}) == PluginConfig(metrics_interval_s=0.0)
    assert from_sources({"uvaple": {"metrics_interval_s": 0.5}}, {}).metrics_interval_s == 0.5


_EXPORT = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO)
if sys.argv[1] != "-":
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
import torch
from uvaple.integration.models.vllm.config import PluginConfig
from uvaple.integration.models.vllm.tables import ShardTable
cfg = PluginConfig(shared=False, metrics_interval_s=float(sys.argv[2]))
shard = ShardTable(cfg, layer="model.embed_per_layer", rows=16, cols=8, dtype=torch.bfloat16, loaded_rows=16,
                   rank=1, size=2, identity="m", device=torch.device("cpu"), check_loaded=False)
shard.finish()
lk = shard.lookup(__import__("uvaple.integration", fromlist=["TableSpec"]).TableSpec.of(shard.table))
lk.lookup(torch.tensor([1, 2, 99]))
import prometheus_client, prometheus_client.multiprocess
if sys.argv[1] == "-":
    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
else:
    from uvaple.integration.models.vllm import tables
    tables._EXPORT["multiprocess"].close()
    reg = prometheus_client.CollectorRegistry()
    prometheus_client.multiprocess.MultiProcessCollector(reg, path=sys.argv[1])
    text = prometheus_client.generate_latest(reg).decode()
rows = [l for l in text.splitlines() if l.startswith("uvaple_rows_total{")]
print(json.dumps(rows))
lk.close(); shard.close()
"""


@pytest.mark.parametrize("mode", ["multiprocess", "single_process", "off"])
def test_shard_lookups_reach_vllms_metrics(tmp_path, mode):
    """A shard's lookup is exported under its layer and rank: pushed into the multiprocess files where
    PROMETHEUS_MULTIPROC_DIR is set (vLLM's engine processes), else read by a collector in
    prometheus_client's default registry; nothing with metrics_interval_s 0."""
    import json
    import subprocess
    import sys

    pytest.importorskip("prometheus_client")
    arg = str(tmp_path) if mode == "multiprocess" else "-"
    r = subprocess.run([sys.executable, "-c", _EXPORT, arg, "0" if mode == "off" else "0.5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    if mode == "off":
        assert rows == []
    else:
        assert len(rows) == 1 and 'lookup="model.embed_per_layer[1/2]"' in rows[0] and rows[0].endswith(" 3.0")
        said = "pushed every 0.5 s into PROMETHEUS_MULTIPROC_DIR" if mode == "multiprocess" else \
            "start vLLM with PROMETHEUS_MULTIPROC_DIR set to an empty directory"
        assert r.stderr.count(said) == 1, r.stderr  # the log says once how the lookups reach /metrics


def test_unknown_environment_variables_warn_and_enable_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert from_sources(None, {"UVAPLE_PLACMENT": "uva"}) is None
    assert "UVAPLE_PLACMENT" in caplog.text


def test_the_test_suites_variables_are_neither_settings_nor_warned_about(caplog):
    """The test suite's knobs (set while a server may start in the same environment) pass in silence."""
    knobs = {"UVAPLE_EQUIV_SCHEDULES": "10", "UVAPLE_EQUIV_FIRST_SEED": "3", "UVAPLE_EQUIV_DEADLINE_S": "60",
             "UVAPLE_EQUIV_SUMMARY": "/tmp/s.json", "UVAPLE_FUZZ_EXAMPLES": "30"}
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert from_sources(None, knobs) is None
    assert "unknown" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert from_sources(None, {**knobs, "UVAPLE_EQUIV_SCHEDULE": "1"}) is None
    assert "UVAPLE_EQUIV_SCHEDULE'" in caplog.text  # a near miss still warns


@pytest.mark.parametrize("entry,match", [
    ({"placment": "uva"}, "unknown key"),
    ({"placement": "gpu"}, "placement: expected one of"),
    ({"placement": 3}, "placement: expected one of"),
    ({"fallback": "device"}, "fallback: expected one of"),
    ({"shared": "maybe"}, "shared: expected true or false"),
    ({"shared": 1}, "shared: expected true or false"),
    ({"segment": "a/b"}, "segment name"),
    ({"segment": ""}, "segment name"),
    ({"segment": "x" * 121}, "segment name"),
    ({"timeout_s": 0}, "positive number"),
    ({"timeout_s": -3}, "positive number"),
    ({"timeout_s": math.nan}, "positive number"),
    ({"timeout_s": math.inf}, "positive number"),
    ({"timeout_s": "soon"}, "positive number"),
    ({"timeout_s": True}, "positive number"),
    ({"segment_dir": "/proc"}, "segment_dir: .*not on a tmpfs"),
    ({"segment_dir": "/nonexistent-uvaple-dir"}, "segment_dir: .*not an existing directory"),
    ({"segment_dir": 5}, "segment_dir: expected a directory path"),
    ({"metrics_interval_s": -1}, "metrics_interval_s: expected 0 .no metrics export. or at least 0.5"),
    ({"metrics_interval_s": 0.01}, "metrics_interval_s: expected 0"),
    ({"metrics_interval_s": math.nan}, "metrics_interval_s: expected"),
    ({"metrics_interval_s": "often"}, "metrics_interval_s: expected"),
    ({"metrics_interval_s": True}, "metrics_interval_s: expected"),
    ({"dedup": "sometimes"}, "dedup: expected true or false"),
    ({"hot_cache_gb": -1}, "hot_cache_gb: expected 0 .no hot set. or a positive number"),
    ({"hot_cache_gb": math.inf}, "hot_cache_gb: expected 0"),
    ({"hot_cache_gb": "lots"}, "hot_cache_gb: expected 0"),
    ({"hot_cache_gb": True}, "hot_cache_gb: expected 0"),
    ({"hot_profile": "/nonexistent-uvaple-ids.npy"}, "hot_profile: expected a readable .npy or text file"),
    ({"hot_profile": 7}, "hot_profile: expected a readable"),
    ({"hot_cache_gb": 0.5}, "hot_cache_gb and hot_profile go together"),
])
def test_bad_settings_are_named(entry, match):
    with pytest.raises(PluginConfigError, match=match):
        from_sources({"uvaple": entry}, {})


@pytest.mark.parametrize("entry,match", [
    ({"placement": "split"}, "placement: 'split' cannot serve vLLM: .*ids on the host.*use 'uva'"),
    ({"placement": " SPLIT "}, "'split' cannot serve vLLM"),
    ({"quantize": "fp8"}, "quantize: expected one of \\['none', 'fp8_row'\\]"),
    ({"quantize": True}, "quantize: expected one of"),
    ({"quantize": "fp8_row", "placement": "copy"},
     "quantize 'fp8_row' with placement 'copy'.*dequantises in the gather \\(\\['uva', 'device', 'disk'\\]\\)"),
    ({"quantize": "fp8_row", "fallback": "copy"}, "quantize 'fp8_row' with fallback 'copy'"),
])
def test_what_the_plugin_cannot_serve_is_named(entry, match):
    """A library placement vLLM cannot use (split gathers from host ids) and a quantised table through the copy
    placement (it serves rows as stored) are refused when the settings are read, naming what to use."""
    with pytest.raises(PluginConfigError, match=match):
        from_sources({"uvaple": entry}, {})


def test_the_quantize_setting():
    assert PluginConfig().quantize == "none"
    assert from_sources({"uvaple": {"quantize": "FP8_ROW"}}, {}) == PluginConfig(quantize="fp8_row")
    assert from_sources(None, {"UVAPLE_QUANTIZE": "fp8_row"}) == PluginConfig(quantize="fp8_row")
    assert from_sources({"uvaple": {"quantize": "none", "placement": "copy"}}, {}).placement == "copy"
    with pytest.raises(PluginConfigError, match="environment variable UVAPLE_QUANTIZE"):
        from_sources(None, {"UVAPLE_QUANTIZE": "int4"})


@pytest.mark.parametrize("placement,graphs,refused", [
    ("copy", True, True), ("copy", False, False), ("uva", True, False), ("device", True, False)])
def test_the_copy_placement_is_refused_under_cuda_graphs(placement, graphs, refused):
    """A copy-placement call waits on the host for its ids: vLLM's graph capture at start-up ended the engine
    (cudaErrorCapturedEvent). Refused before anything is built, naming enforce_eager and uva; eager is served."""
    from uvaple.integration.models.vllm.config import check_engine

    cfg = PluginConfig(placement=placement)
    if refused:
        with pytest.raises(PluginConfigError, match="placement 'copy' cannot run inside vLLM's CUDA graphs.*"
                                                    "enforce_eager=True .--enforce-eager.*placement 'uva'"):
            check_engine(cfg, cuda_graphs=graphs)
    else:
        check_engine(cfg, cuda_graphs=graphs)


def test_the_engines_graph_mode_is_read_from_its_config():
    """``cudagraph_mode`` as vLLM resolves it (an enum: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY,
    FULL_AND_PIECEWISE); ``enforce_eager`` means no graphs whatever the mode says."""
    import enum
    from types import SimpleNamespace

    from uvaple.integration.models.vllm._build import cuda_graphs

    Mode = enum.Enum("CUDAGraphMode", {"NONE": 0, "PIECEWISE": 1, "FULL": 2, "FULL_DECODE_ONLY": (2, 0),
                                       "FULL_AND_PIECEWISE": (2, 1)})

    def cfg(mode, eager=False):
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                               compilation_config=SimpleNamespace(cudagraph_mode=mode))

    assert not cuda_graphs(cfg(Mode.NONE))
    assert all(cuda_graphs(cfg(m)) for m in Mode if m is not Mode.NONE)
    assert not cuda_graphs(cfg(Mode.FULL_AND_PIECEWISE, eager=True))
    assert not cuda_graphs(cfg(None))
    assert not cuda_graphs(SimpleNamespace())


def test_the_token_id_levers_settings(tmp_path):
    """dedup and the hot set (size and profile together, the uva placement only), from either source."""
    ids = tmp_path / "ids.txt"
    ids.write_text("5 6 7")
    assert from_sources(None, {"UVAPLE_DEDUP": "on"}) == PluginConfig(dedup=True)
    got = from_sources({"uvaple": {"hot_cache_gb": 0.25}}, {"UVAPLE_HOT_PROFILE": str(ids)})
    assert got == PluginConfig(hot_cache_gb=0.25, hot_profile=str(ids))
    assert from_sources({"uvaple": {"hot_cache_gb": 0}}, {}) == PluginConfig()
    with pytest.raises(PluginConfigError, match="go together"):
        from_sources(None, {"UVAPLE_HOT_PROFILE": str(ids)})
    for placement in ("copy", "device"):
        with pytest.raises(PluginConfigError, match=f"a hot set stands in front of rows in host memory that the GPU "
                                                     f"reads .placement \\['uva'\\]., not of placement '{placement}'"):
            from_sources({"uvaple": {"hot_cache_gb": 1, "hot_profile": str(ids), "placement": placement}}, {})


def test_bad_environment_and_a_non_object_entry_are_named():
    with pytest.raises(PluginConfigError, match="environment variable UVAPLE_TIMEOUT_S"):
        from_sources(None, {"UVAPLE_TIMEOUT_S": "-1"})
    with pytest.raises(PluginConfigError, match="object of settings"):
        from_sources({"uvaple": ["uva"]}, {})


# ------------------------------------------------------------------ names
def test_segment_names_follow_the_rules_and_differ_by_layer():
    long = "model.language_model.layers." + "x" * 300 + ".ple.ngram_embedding"
    names = {segment_name("b" * 120, layer, 3, 8) for layer in (long, long + "2", "a b/c", "a_b_c")}
    assert len(names) == 4
    assert all(len(n) <= 200 and all(c.isalnum() or c in "_.-" for c in n) for n in names)
    assert segment_name("base", "model.layers.0.x", 1, 2) == "base.model.layers.0.x.r1of2"


def test_the_identity_follows_the_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"a" * 10)
    a = model_identity(str(tmp_path), None, torch.bfloat16, None)
    assert a == model_identity(str(tmp_path), None, torch.bfloat16, None)
    assert a != model_identity(str(tmp_path), "v2", torch.bfloat16, None)
    assert a != model_identity(str(tmp_path), None, torch.bfloat16, "fp8")
    (tmp_path / "model.safetensors").write_bytes(b"b" * 11)
    assert a != model_identity(str(tmp_path), None, torch.bfloat16, None)


# ------------------------------------------------------------------ shard tables
def shard(cfg: PluginConfig, *, rows=96, loaded=90, layer="m.layers.0.ple", identity="i" * 64, **kw) -> ShardTable:
    return ShardTable(cfg, layer=layer, rows=rows, cols=40, dtype=torch.bfloat16, loaded_rows=loaded, rank=0,
                      size=1, identity=identity, device=CPU, **kw)


def test_a_private_shard_is_filled_checked_and_read():
    s = shard(PluginConfig(shared=False))
    w = rand(90, 40, torch.float32, seed=1)
    s.write(w[:50], 0)
    with pytest.raises(PluginLoadError, match="left 40 of 90 rows"):
        s.finish()
    s.write(w[40:], 40)  # overlapping writes count once
    assert s.missing_rows() == 0
    s.finish()
    s.finish()  # idempotent
    assert torch.equal(bits(s.tensor[:90]), bits(w.to(torch.bfloat16)))  # cast as vLLM's copy_ casts
    from uvaple.integration import TableSpec

    lk = s.lookup(TableSpec.of(s.table))
    ids = torch.tensor([0, 89, 95, 96, -1])
    got = lk.lookup(ids)
    assert torch.equal(bits(got[:2]), bits(w.to(torch.bfloat16)[[0, 89]]))
    assert torch.equal(bits(got[3:]), bits(torch.zeros(2, 40, dtype=torch.bfloat16)))
    with pytest.raises(PluginLoadError, match="do not fit"):
        s.write(w[:10], 90)
    with pytest.raises(PluginLoadError, match="do not fit"):
        s.write(torch.zeros(3, 41), 0)
    s.close()


# a few seconds a case interpreted (calls of 300 and 1,024 ids): a shard starting past id 0 by default
@pytest.mark.parametrize("start", [pytest.param(0, marks=pytest.mark.extended), 1000])
def test_a_shard_serves_dedup_and_its_hot_set(tmp_path, start, monkeypatch):
    """A rank's shard (global ids ``start ..``) with dedup and a hot set ranked on a file of global token ids:
    the shard's most frequent rows are held, ids of other shards in the profile count for nothing, and
    lookups (decode-sized and prefill-sized, repeats, out-of-range ids) give the table's bits. The bound from
    which a lookup with a hot set de-duplicates (4,096 ids) is lowered to 1,024 here, so that a prefill-sized
    call takes either side of it at a quarter of the interpreted time."""
    from uvaple.integration import TableSpec
    from uvaple.kernels import tuning

    monkeypatch.setattr(tuning, "DEDUP_MIN_IDS_HOT", 1024)
    g = torch.Generator().manual_seed(7)
    profile = torch.cat([torch.full((50,), start + 3), torch.full((40,), start + 80), torch.full((30,), start + 41),
                         torch.full((99,), start + 95),  # padding rows: past the loaded ones, never held
                         torch.full((200,), start - 1), torch.full((200,), start + 96),  # other shards' ids
                         start + torch.randint(0, 90, (60,), generator=g)])
    path = tmp_path / "ids.npy"
    np.save(path, profile.numpy())
    # room for 3 rows of 80 B beside the map (4 B a row) and the slot lists (12 B a slot)
    cfg = PluginConfig(shared=False, dedup=True, hot_cache_gb=(96 * 4 + 3 * (80 + 12) + 8) / 1e9,
                       hot_profile=str(path))
    s = shard(cfg)
    w = rand(90, 40, torch.float32, seed=2).to(torch.bfloat16)
    s.write(w, 0)
    s.finish()
    lk = s.lookup(TableSpec.of(s.table), max_rows=4096, id_start=start)
    try:
        assert lk.dedup and lk.hot is not None and lk.hot.capacity == 3
        assert sorted(lk.hot.held[: lk.hot.size].tolist()) == [3, 41, 80]
        for n in (7, 300, 1024):
            ids = torch.randint(0, 96, (n,), generator=g)
            ids[:5] = torch.tensor([3, 3, 80, -1, 200])
            got = lk.lookup(ids)
            want = torch.where(((ids >= 0) & (ids < 96)).view(-1, 1), s.tensor[ids.clamp(0, 95)],
                               torch.zeros((), dtype=torch.bfloat16))
            assert torch.equal(bits(got), bits(want)), n
        assert not lk.uses_sorted(300) and not lk.uses_sorted(7)
        assert lk.uses_sorted(tuning.dedup_min_ids(hot=True)) and tuning.dedup_min_ids(hot=True) == 1024
        assert lk.stats()["hot_hits"] > 0
    finally:
        lk.close()
        s.close()


def test_the_hot_set_refuses_n_gram_tables_and_names_a_bad_profile(tmp_path):
    from uvaple.integration import TableSpec

    bad = tmp_path / "ids.txt"
    bad.write_text("1 2 three")
    s = shard(PluginConfig(shared=False, hot_cache_gb=0.001, hot_profile=str(bad)))
    s.write(rand(90, 40, torch.float32, seed=3), 0)
    s.finish()
    try:
        with pytest.raises(PluginConfigError, match="hashed n-gram ids"):
            s.lookup(TableSpec.of(s.table), max_rows=64, token_ids=False)
        with pytest.raises(PluginConfigError, match="hot_profile .* is not a .npy file or a text file of integer"):
            s.lookup(TableSpec.of(s.table), max_rows=64)
    finally:
        s.close()
    tiny = tmp_path / "ok.txt"
    tiny.write_text("1 2")
    s = shard(PluginConfig(shared=False, hot_cache_gb=1e-7, hot_profile=str(tiny)))
    s.write(rand(90, 40, torch.float32, seed=3), 0)
    s.finish()
    try:
        with pytest.raises(PluginConfigError, match="hot_cache_gb=1e-07: .*holds no row"):
            s.lookup(TableSpec.of(s.table), max_rows=64)
    finally:
        s.close()


def fp8_shard(cfg: PluginConfig, *, rows=96, loaded=90, cols=40, dtype=torch.bfloat16, **kw) -> ShardTable:
    return ShardTable(cfg, layer="m.layers.1.ple", rows=rows, cols=cols, dtype=dtype, loaded_rows=loaded, rank=0,
                      size=1, identity="q" * 64, device=CPU, encoding="fp8_row", **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_fp8_row_shard_is_quantised_on_load_byte_for_byte(dtype):
    """quantize fp8_row: vLLM's loader writes [rows, cols] checkpoint rows (in pieces, as the checkpoint's
    shards arrive); the shard holds the encoding's bytes (codes then a float32 scale per row) exactly as the
    registry's torch quantiser makes them, and the lookup returns the registry's reference rows, bit for bit."""
    from uvaple.integration import TableSpec
    from uvaple.kernels.encodings import ENCODINGS, quantize_fp8_rows

    s = fp8_shard(PluginConfig(shared=False, metrics_interval_s=0), cols=37, dtype=dtype)
    assert s.tensor.shape == (96, 37) and s.tensor.dtype == torch.float8_e4m3fn  # the parameter vLLM loads
    assert s.table.shape == (96, 41)
    w = rand(90, 37, dtype, seed=5)
    w[3] = 0  # a zero row, a subnormal and a huge value: the quantiser's hard cases
    w[4, 0], w[5, 1] = 1e-7, 3e4
    for a, b in ((0, 31), (31, 77), (77, 90)):
        s.write(w[a:b], a)
    s.finish()
    want = quantize_fp8_rows(w)
    assert torch.equal(bits(s.table.tensor[:90]), bits(want))
    assert s.quant_error.rows == 90 and s.quant_error.max_rel.max() < 0.07
    lk = s.lookup(TableSpec.of(s.table, encoding="fp8_row", out_dtype=torch.bfloat16), token_ids=False)
    ids = torch.tensor([0, 89, 3, 4, 5, 17, 17, 95, 200, -3])
    out = torch.full((10, 37), float("nan"), dtype=torch.bfloat16)
    lk.lookup(ids, out)
    ref = ENCODINGS["fp8_row"].dequantise(want[ids[:7]], torch.bfloat16)
    assert torch.equal(bits(out[:7]), bits(ref))
    assert torch.equal(bits(out[7:]), bits(torch.zeros(3, 37, dtype=torch.bfloat16)))
    s.close()


def test_an_fp8_row_shard_refuses_what_it_cannot_quantise():
    with pytest.raises(PluginConfigError, match="quantize fp8_row takes a bf16/fp16/fp32 table.*float8_e4m3fn"):
        fp8_shard(PluginConfig(shared=False), dtype=torch.float8_e4m3fn)
    with pytest.raises(PluginConfigError, match="raw or as fp8_row"):
        shard(PluginConfig(shared=False), encoding="int4")
    s = fp8_shard(PluginConfig(shared=False))
    with pytest.raises(PluginLoadError, match="takes bf16/fp16/fp32 checkpoint rows"):
        s.write(torch.zeros(4, 40, dtype=torch.float8_e4m3fn), 0)
    bad = rand(8, 40, torch.bfloat16, seed=6)
    bad[5, 7] = float("inf")
    with pytest.raises(PluginLoadError, match="m.layers.1.ple: row 15 holds inf or NaN"):
        s.write(bad, 10)
    with pytest.raises(PluginLoadError, match="do not fit the shard of 96 x 40"):
        s.write(rand(4, 41, torch.bfloat16, seed=7), 0)
    s.close()


def test_an_fp8_row_shard_with_dummy_weights_holds_rows_drawn_like_vllms_dummy_bf16_rows():
    """load_format="dummy": vLLM fills the codes parameter with its dummy_weight_value and never writes the scales;
    finish writes every row as the encoding of values uniform in +-1e-3 (vLLM's dummy range for bf16): rows of one
    value made a dummy model compute differently from the bf16 table (fewer experts routed), seeded, the same
    bytes every time."""
    from uvaple.integration import TableSpec
    from uvaple.integration.models.vllm.tables import DUMMY_CODE, DUMMY_RANGE
    from uvaple.kernels.encodings import ENCODINGS

    made = []
    for _ in range(2):
        s = fp8_shard(PluginConfig(shared=False, metrics_interval_s=0), rows=70_000, loaded=70_000,
                      check_loaded=False)
        s.tensor.fill_(DUMMY_CODE)  # what vLLM's dummy loader does with the parameter's dummy_weight_value
        s.finish()
        made.append(s)
    a, b = made
    assert torch.equal(bits(a.table.tensor), bits(b.table.tensor))  # seeded: the same table every time
    lk = a.lookup(TableSpec.of(a.table, encoding="fp8_row", out_dtype=torch.bfloat16), token_ids=False)
    ids = torch.tensor([0, 1, 65_535, 65_536, 69_999])  # both sides of a block of rows
    out = lk.lookup(ids)
    assert torch.equal(bits(out), bits(ENCODINGS["fp8_row"].dequantise(a.table.tensor[ids], torch.bfloat16)))
    vals = out.float()
    assert vals.abs().max() <= DUMMY_RANGE * 1.01 and vals.abs().max() > 0.9 * DUMMY_RANGE
    # not one value: every row spreads over many of the encoding's levels (about 30 of 40 values distinct where
    # drawn; the count depends on torch's generator, so the bound is far below it), and no two rows are equal,
    # within a block of rows or across one
    assert min(len(torch.unique(row)) for row in vals) >= 10
    assert all(not torch.equal(out[i], out[j]) for i in range(len(ids)) for j in range(i))
    for s in made:
        s.close()


def test_a_shared_fp8_row_shard_is_quantised_once_and_attached():
    cfg = PluginConfig(segment=_name(), timeout_s=5, metrics_interval_s=0)
    creator, attacher = fp8_shard(cfg), fp8_shard(cfg)
    try:
        assert creator.fills and not attacher.fills
        w = rand(90, 40, torch.bfloat16, seed=8)
        attacher.write(w, 0)  # checked, not quantised: the creator writes
        assert attacher.quant_error is None
        creator.write(w, 0)
        creator.finish()
        attacher.finish()
        from uvaple.kernels.encodings import quantize_fp8_rows

        assert torch.equal(bits(attacher.table.tensor[:90]), bits(quantize_fp8_rows(w)))
    finally:
        attacher.close()
        creator.close()


def test_dummy_weights_need_no_rows():
    s = shard(PluginConfig(shared=False), check_loaded=False)
    s.finish()
    s.close()


def _name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def test_one_creator_fills_and_an_attacher_reads_the_same_memory():
    cfg = PluginConfig(segment=_name(), timeout_s=5)
    creator = shard(cfg)
    attacher = shard(cfg)  # another process in production; a second open in this one here
    try:
        assert creator.fills and not attacher.fills and creator.name == attacher.name
        w = rand(90, 40, torch.bfloat16, seed=2)
        attacher.write(w, 0)  # the attacher's loader: checked, not written
        assert torch.equal(bits(creator.tensor[:90]), bits(torch.zeros(90, 40, dtype=torch.bfloat16)))
        with pytest.raises(SharedSegmentTimeout):
            attacher.table.wait_ready(0.2)  # bounded: the creator has not finished
        creator.write(w, 0)
        creator.finish()
        attacher.finish()
        assert torch.equal(bits(attacher.tensor[:90]), bits(w))
        assert attacher.table.ptr != creator.table.ptr  # two mappings of one segment
    finally:
        attacher.close()
        creator.close()
    assert not os.path.exists(f"/dev/shm/uvaple.{creator.name}")


def test_shards_live_in_the_configured_directory():
    d = f"/dev/shm/uvaple-test-dir-{uuid.uuid4().hex[:8]}"  # a directory on a tmpfs, as a mount would be
    os.mkdir(d)
    try:
        cfg = from_sources({"uvaple": {"segment": _name(), "timeout_s": 5}}, {"UVAPLE_SEGMENT_DIR": d})
        assert cfg.segment_dir == d
        creator, attacher = shard(cfg), shard(cfg)
        w = rand(90, 40, torch.bfloat16, seed=4)
        creator.write(w, 0)
        attacher.write(w, 0)
        creator.finish()
        attacher.finish()
        assert os.listdir(d) == [f"uvaple.{creator.name}"] and not os.path.exists(f"/dev/shm/uvaple.{creator.name}")
        assert torch.equal(bits(attacher.tensor[:90]), bits(w))
        attacher.close()
        creator.close()
        assert os.listdir(d) == []
    finally:
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


def test_a_creator_missing_rows_fails_its_waiters_with_the_reason():
    cfg = PluginConfig(segment=_name(), timeout_s=5)
    creator, attacher = shard(cfg), shard(cfg)
    try:
        creator.write(rand(10, 40, torch.bfloat16, seed=3), 0)
        with pytest.raises(PluginLoadError, match="left 80 of 90 rows"):
            creator.finish()
        attacher.write(rand(90, 40, torch.bfloat16, seed=3), 0)
        with pytest.raises(SharedSegmentError, match="left 80 of 90 rows"):
            attacher.finish()
    finally:
        attacher.close()
        creator.close()


def test_another_models_segment_is_not_attached():
    cfg = PluginConfig(segment=_name(), timeout_s=5)
    a = shard(cfg, identity="a" * 64)
    try:
        with pytest.raises(SharedSegmentError):
            shard(cfg, identity="b" * 64)
    finally:
        a.close()


@pytest.mark.parametrize("error", [
    DeviceCapabilityError("GPU 0 does not support using the host pointer of registered memory"),
    RegistrationError("cudaHostRegister failed for 1 MiB: raise `ulimit -l`")])
def test_uva_unusable_is_named_at_once_or_falls_back_to_copy(monkeypatch, error):
    """Registration makes the doctor's checks; its failure is a named error, or the copy placement when
    configured."""
    from uvaple.uva import HostTable

    real = HostTable.empty.__func__

    def empty(cls, *a, register="auto", **kw):
        if register:
            raise error
        return real(cls, *a, register=register, **kw)

    monkeypatch.setattr(HostTable, "empty", classmethod(empty))
    args = dict(layer="l", rows=8, cols=8, dtype=torch.bfloat16, loaded_rows=8, rank=0, size=1, identity="i" * 64,
                device=torch.device("cuda", 0))
    with pytest.raises(UvaUnavailable, match=f"{str(error)[:20]}.*uvaple doctor.*fallback"):
        ShardTable(PluginConfig(shared=False), **args)
    s = ShardTable(PluginConfig(shared=False, fallback="copy"), **args)
    assert s.placement == "copy" and not s.table.registered
    s.close()
    # under CUDA graphs the copy fallback could not be captured: named, with what to do, and nothing left open
    with pytest.raises(UvaUnavailable, match=f"{str(error)[:20]}.*its copy fallback cannot run inside vLLM's CUDA "
                                             "graphs: start with enforce_eager=True"):
        ShardTable(PluginConfig(shared=False, fallback="copy"), cuda_graphs=True, **args)


def test_node_memory_follows_both_sizing_rules():
    from uvaple.integration.models.vllm.memory import next_pow2, node_memory
    from uvaple.uva import segments, system

    rows = int(47.7 * (1 << 30)) // 160
    one = node_memory(rows, 160, tp=1, dp=1)
    assert one.vllm_bytes == 64 << 30  # torch's pinned allocator: the next power of two
    assert one.uvaple_bytes == segments.DATA_OFFSET + system.round_up(one.rows_per_rank * 160, system.PAGE_SIZE)
    assert one.rows_per_rank % 128 == 0 and one.rows_per_rank - rows < 128
    two = node_memory(rows, 160, tp=2, dp=2)
    assert two.vllm_bytes == 4 * next_pow2(two.rows_per_rank * 160)  # every rank of every replica
    assert abs(two.uvaple_bytes - one.uvaple_bytes) <= segments.DATA_OFFSET + system.PAGE_SIZE  # once a node
    assert node_memory(rows, 160, tp=2, dp=8).uvaple_bytes == two.uvaple_bytes
    with pytest.raises(ValueError, match="do not split"):
        node_memory(1000, 160, tp=3, dp=1)
