"""The vLLM plugin and an engine's ``--additional-config``, without vLLM: ``check_model`` reads a
``VllmConfig``'s attributes only, so a stand-in config tests it (the plugin's model tests are in tests_vllm/).

Point 7 of the CLI issue: a ``"uvaple"`` entry for a model the plugin does not serve used to be ignored
without a word (vLLM builds its own model class, which never reads it).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

import uvaple.integration.models.vllm as plugin


def engine(architectures, additional=None, model="org/some-model"):
    """A stand-in for vLLM's ``VllmConfig``: the attributes the plugin reads."""
    return SimpleNamespace(model_config=SimpleNamespace(model=model, architectures=architectures),
                           additional_config=additional or {})


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not warned yet."""
    monkeypatch.setattr(plugin, "_warned_unserved", False)


def test_an_entry_for_a_model_the_plugin_does_not_serve_is_warned_once(fresh, caplog):
    """Point 7: a "uvaple" entry (here a bad one) for a model the plugin does not serve: one warning per
    process, naming the key, the model and what the plugin serves."""
    cfg = engine(["LlamaForCausalLM"], {"uvaple": {"placment": "uva"}}, model="meta-llama/Llama-3.1-8B")
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert plugin.check_model(cfg) is False
        assert plugin.check_model(cfg) is False  # a second engine of the same process: no second warning
    [rec] = [r for r in caplog.records if r.name == "uvaple.vllm"]
    assert rec.levelno == logging.WARNING
    msg = rec.getMessage()
    assert '"uvaple" entry' in msg and "--additional-config" in msg
    assert "meta-llama/Llama-3.1-8B" in msg and "LlamaForCausalLM" in msg and "is ignored" in msg
    assert all(arch in msg for arch in plugin.MODELS)


@pytest.mark.parametrize("archs,additional", [
    (["Gemma3nForConditionalGeneration"], {"uvaple": {}}),  # served: the plugin's class reads the entry
    (["Qwen4ExpForCausalLM"], {"uvaple": {"placement": "copy"}}),
    (["LlamaForCausalLM"], {}),  # no entry: nothing to say
    (["LlamaForCausalLM"], {"other_plugin": {"x": 1}}),
])
def test_nothing_is_said_where_the_entry_is_read_or_absent(fresh, caplog, archs, additional):
    """Point 7: a served model (its entry is read and checked when the model is built), or no "uvaple" entry:
    no warning."""
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert plugin.check_model(engine(archs, additional)) is (archs[0] in plugin.MODELS)
    assert not [r for r in caplog.records if r.name == "uvaple.vllm"]


def test_the_architectures_come_from_the_hf_config_where_the_model_config_has_none(fresh, caplog):
    """Point 7: a model config that keeps its architectures on ``hf_config`` only is read there too."""
    cfg = SimpleNamespace(model_config=SimpleNamespace(model="m", hf_config=SimpleNamespace(
        architectures=["Gemma3nForCausalLM"])), additional_config={"uvaple": {}})
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert plugin.check_model(cfg) is True
    assert not caplog.records


@pytest.mark.parametrize("placement", ["uva", "device", "copy"])
def test_a_shards_lookup_names_its_placement_in_the_startup_log(caplog, placement):
    """Each shard's lookup says, once, at startup, which placement serves it and from which host table."""
    import torch

    from uvaple.integration import TableSpec
    from uvaple.integration.models.vllm.config import PluginConfig
    from uvaple.integration.models.vllm.tables import ShardTable

    s = ShardTable(PluginConfig(shared=False, placement=placement, metrics_interval_s=0), layer="m.layers.3.ple",
                   rows=16, cols=8, dtype=torch.bfloat16, loaded_rows=16, rank=0, size=1, identity="i",
                   device=torch.device("cpu"), check_loaded=False)
    s.finish()
    with caplog.at_level(logging.INFO, logger="uvaple.vllm"):
        lk = s.lookup(TableSpec.of(s.table), max_rows=4)
    lines = [r.getMessage() for r in caplog.records if "served by" in r.getMessage()]
    assert lines == [f"uvaple: m.layers.3.ple[0/1] served by the {placement} placement from a private host table "
                     "(unnamed)"]
    lk.close()
    s.table.close()
