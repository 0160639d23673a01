"""The plugin as vLLM sees it: discovery, registration, the version guard, enabling; TP=2 and two replicas."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import pytest
import torch
from conftest import bits, free_port, rand

import uvaple.integration.models.vllm as plugin
from uvaple.integration.models.vllm import PluginConfigError, _build

HERE = os.path.dirname(os.path.abspath(__file__))


def test_the_entry_point_is_discovered_by_vllm():
    from importlib.metadata import entry_points

    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    eps = {e.name: e.value for e in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert eps.get("uvaple") == "uvaple.integration.models.vllm:register"
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["uvaple"] is plugin.register


def test_register_is_reentrant_and_registers_lazy_classes():
    from vllm import ModelRegistry

    assert plugin.register() and plugin.register()
    for arch, target in plugin.MODELS.items():
        entry = ModelRegistry.models[arch]
        assert f"{entry.module_name}:{entry.class_name}" == target
        assert arch in ModelRegistry.get_supported_archs()


def test_vllms_config_check_runs_the_plugins_after_its_own(monkeypatch):
    """Each architecture the plugin serves: vLLM's own per-architecture config check (a subclass of it, or of its
    no-op base where vLLM has none), then the plugin's settings check, when vLLM builds the engine's config."""
    from types import SimpleNamespace

    from vllm.model_executor.models import config as model_configs

    assert plugin.register()
    table = model_configs.MODELS_CONFIG_MAP
    entries = {arch: table[arch] for arch in plugin.MODELS}
    for arch, entry in entries.items():
        assert entry._uvaple_checks_settings and entry.__mro__[1].__name__ == (
            f"{arch}Config" if arch.startswith("Qwen4Exp") else "VerifyAndUpdateConfig")
    plugin._check_settings_with_the_config()  # again: nothing wrapped twice
    assert {arch: table[arch] for arch in plugin.MODELS} == entries
    order = []
    qwen = entries["Qwen4ExpForCausalLM"]
    monkeypatch.setattr(qwen.__mro__[1], "verify_and_update_config",
                        staticmethod(lambda cfg: order.append("vllm")))
    bad = SimpleNamespace(additional_config={"uvaple": {"placement": "gpu"}})
    with pytest.raises(PluginConfigError, match='"uvaple".placement: expected one of'):
        qwen.verify_and_update_config(bad)
    assert order == ["vllm"]  # vLLM's own check first, then the plugin's
    entries["Gemma3nForConditionalGeneration"].verify_and_update_config(
        SimpleNamespace(additional_config={"uvaple": {"placement": "uva"}}))  # a good setting passes
    entries["Gemma3nForCausalLM"].verify_and_update_config(SimpleNamespace(additional_config=None))  # none: off
    monkeypatch.setenv("UVAPLE_PLACEMENT", "gpu")  # the environment is the other source
    with pytest.raises(PluginConfigError, match="UVAPLE_PLACEMENT: expected one of"):
        entries["Gemma3nForCausalLM"].verify_and_update_config(SimpleNamespace(additional_config=None))


def test_an_unsupported_vllm_leaves_everything_untouched(monkeypatch, caplog):
    import vllm
    from vllm import ModelRegistry

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    before = {a: ModelRegistry.models.get(a) for a in plugin.MODELS}
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a: pytest.fail("registered on 0.34"))
    with caplog.at_level(logging.WARNING, logger="uvaple.vllm"):
        assert plugin.register() is False
    assert "vLLM 0.34.0 is not supported" in caplog.text and "stays inert" in caplog.text
    assert {a: ModelRegistry.models.get(a) for a in plugin.MODELS} == before
    assert [plugin.supported(v) for v in ("0.33.0", "0.33.2.dev3+gabc", "0.32.9", "1.33.0", "0.330", "")] == \
        [True, True, False, False, False, False]


def test_a_bad_environment_stops_the_process_with_a_named_error(monkeypatch):
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("UVAPLE_PLACEMENT", "gpu")
    with pytest.raises(PluginConfigError, match="UVAPLE_PLACEMENT: expected one of"):
        plugin.register()


def test_enabled_only_when_asked(monkeypatch):
    from conftest import vllm_config

    assert _build.plugin_config(vllm_config()) is None
    assert _build.plugin_config(vllm_config(additional_config={"other": 1})) is None
    cfg = _build.plugin_config(vllm_config(additional_config={"uvaple": {}}))
    assert cfg == plugin.PluginConfig()
    monkeypatch.setenv("UVAPLE_SHARED", "0")
    assert _build.plugin_config(vllm_config()) == plugin.PluginConfig(shared=False)
    cfg = _build.plugin_config(vllm_config(additional_config={"uvaple": {"shared": True, "placement": "copy"}}))
    assert cfg == plugin.PluginConfig(shared=True, placement="copy")  # the additional config wins


def test_qwen4exp_on_rocm_is_refused_before_anything_is_built(monkeypatch):
    from conftest import vllm_config
    from vllm.platforms import current_platform

    from uvaple.integration.models.vllm.qwen4_exp import UvapleQwen4ExpForCausalLM

    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: True)
    built = []
    monkeypatch.setattr(_build, "building", lambda *a, **k: built.append(a))
    with pytest.raises(PluginConfigError, match="run on CUDA"):
        UvapleQwen4ExpForCausalLM(vllm_config=vllm_config(additional_config={"uvaple": {}}))
    assert built == []


@pytest.mark.parametrize("model", ["qwen4exp", "gemma3n"])
def test_the_copy_placement_under_vllms_cuda_graphs_is_refused_before_anything_is_built(monkeypatch, model):
    """vLLM's default on a GPU: compilation and CUDA graphs (FULL_AND_PIECEWISE). A copy-placement call waits on
    the host, so the capture at start-up ended the engine (cudaErrorCapturedEvent, then the copy worker died):
    now a named error before any table exists. enforce_eager (cudagraph_mode NONE) builds."""
    from conftest import vllm_config
    from vllm.config.compilation import CUDAGraphMode

    from uvaple.integration.models.vllm.gemma3n import UvapleGemma3nForConditionalGeneration
    from uvaple.integration.models.vllm.qwen4_exp import UvapleQwen4ExpForCausalLM

    cls = UvapleQwen4ExpForCausalLM if model == "qwen4exp" else UvapleGemma3nForConditionalGeneration
    cfg = vllm_config(additional_config={"uvaple": {"placement": "copy"}})
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE  # as vLLM resolves it on CUDA
    assert _build.cuda_graphs(cfg)
    built = []
    monkeypatch.setattr(_build, "building", lambda *a, **k: built.append(a))
    with pytest.raises(PluginConfigError, match="placement 'copy' cannot run inside vLLM's CUDA graphs.*"
                                                "enforce_eager=True .--enforce-eager."):
        cls(vllm_config=cfg)
    assert built == []
    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    assert not _build.cuda_graphs(cfg)


def test_gemma3n_refuses_quantize_before_anything_is_built(monkeypatch):
    from conftest import vllm_config

    from uvaple.integration.models.vllm.gemma3n import UvapleGemma3nForCausalLM

    built = []
    monkeypatch.setattr(_build, "building", lambda *a, **k: built.append(a))
    with pytest.raises(PluginConfigError, match="quantize 'fp8_row': the plugin quantises Qwen4Exp's n-gram tables"):
        UvapleGemma3nForCausalLM(vllm_config=vllm_config(additional_config={"uvaple": {"quantize": "fp8_row"}}))
    assert built == []


def test_a_plugin_model_without_swaps_is_refused_when_defined():
    with pytest.raises(TypeError, match="must define _uvaple_swaps"):
        type("NoSwaps", (_build.PluginModel,), {})


def _run(mode: str, nprocs: int, tmp_path, base: str) -> list[dict]:
    ports: list[int] = []  # one group (tp): every rank's is the first; world-1 replicas (dp): one each
    while len(ports) < nprocs:
        port = free_port()
        if port not in ports:
            ports.append(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UVAPLE_")}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "_rank.py"), mode, str(r), str(nprocs),
                               str(ports[0] if mode == "tp" else ports[r]), base, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(nprocs)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return [torch.load(tmp_path / f"r{r}.pt") for r in range(nprocs)]


def _tp1(kind: str, ids_seed: int = 22) -> torch.Tensor:
    """TP=1's rows for the processes' ids: vLLM's formula on the full table."""
    from _rank import DIM, HEADS, TOKENS, VOCAB

    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    w = rand(VOCAB, DIM, torch.float32, seed=21).to(dtype)
    ids = torch.randint(0, VOCAB, (TOKENS, HEADS), generator=torch.Generator().manual_seed(ids_seed))
    ids[0] = torch.tensor([0, 499, 500, 999])
    rows = w[ids].to(torch.bfloat16)
    return rows * torch.tensor([0.0291]).to(torch.bfloat16) if kind == "fp8" else rows


def test_tp2_over_gloo_is_vllms_and_tp1s(tmp_path):
    base = f"t{uuid.uuid4().hex[:8]}"
    ranks = _run("tp", 2, tmp_path, base)
    for kind in ("bf16", "fp8"):
        a, b = ranks[0][kind], ranks[1][kind]
        assert a["created"] and b["created"] and a["name"] != b["name"]  # a segment per vocabulary shard
        assert a["rows"] == b["rows"] == 512  # vLLM's padded shard of 1024 rows, once per rank: the table once
        mine = [f for f in a["segments"] if f".{kind}." in f]
        assert [f.rsplit(".", 1)[1] for f in mine] == ["r0of2", "r1of2"]  # the node's only copy of the table
        for r in (a, b):
            assert torch.equal(bits(r["ours"]), bits(r["ref"]))  # vLLM's TP=2 (masked rows, all-reduce)
            assert torch.equal(bits(r["ours"]), bits(_tp1(kind)))  # and TP=1's rows
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"uvaple.{base}.")]  # all released


def test_two_replicas_attach_one_segment_and_agree_with_tp1(tmp_path):
    base = f"d{uuid.uuid4().hex[:8]}"
    reps = _run("dp", 2, tmp_path, base)
    for kind in ("bf16", "fp8"):
        a, b = reps[0][kind], reps[1][kind]
        assert a["name"] == b["name"] and sorted([a["created"], b["created"]]) == [False, True]
        for r in (a, b):
            assert len([s for s in r["segments"] if f".{kind}." in s]) == 1  # one copy on the node
            assert torch.equal(bits(r["ours"]), bits(_tp1(kind)))
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"uvaple.{base}.")]
