"""Gemma 3n through vLLM's own loader (``get_model``): the plugin's ``embed_tokens_per_layer`` against vLLM's.

A tiny random Gemma 3n is saved as a checkpoint (HF transformers' own model and ``save_pretrained``), then
built twice by vLLM with the plugin registered: not enabled (vLLM's model exactly) and enabled. The
multimodal class is built with no image or audio allowed per prompt, so vLLM skips its towers (they need
timm, and they do not touch the per-layer embedding).
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import bits
from safetensors.torch import save_file

from uvaple.integration.models.vllm import PluginConfigError, register
from uvaple.integration.models.vllm.gemma3n import UvapleEmbeddingMethod, UvapleGemma3nForCausalLM

LAYERS, VOCAB, PLE_VOCAB = 3, 512, 384
MAX_TOKENS = 64


def _text_config():
    from transformers import Gemma3nTextConfig

    return Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=PLE_VOCAB, hidden_size=64, hidden_size_per_layer_input=256,
        intermediate_size=[128] * LAYERS, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_kv_shared_layers=1, laurel_rank=8, altup_num_inputs=4,
        activation_sparsity_pattern=[0.0] * LAYERS, sliding_window=16, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention", "full_attention"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(text-only dir, multimodal dir, the per-layer table) of one random model."""
    from transformers import Gemma3nConfig
    from transformers import Gemma3nForCausalLM as HFGemma3n

    torch.manual_seed(0)
    text = _text_config()
    text.architectures = ["Gemma3nForCausalLM"]
    hf = HFGemma3n(text).to(torch.bfloat16)
    with torch.no_grad():  # random rows of every magnitude (an initialiser's small values would hide bugs)
        hf.model.embed_tokens_per_layer.weight.normal_(0, 3)
    d_text = tmp_path_factory.mktemp("gemma3n_text")
    hf.save_pretrained(d_text)
    # the multimodal checkpoint: the same text weights under the names transformers gives them there
    d_mm = tmp_path_factory.mktemp("gemma3n_mm")
    full = Gemma3nConfig(text_config=text.to_dict())
    full.architectures = ["Gemma3nForConditionalGeneration"]
    full.save_pretrained(d_mm)
    sd = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in hf.state_dict().items()
          if k.startswith("model.")}
    save_file(sd, str(d_mm / "model.safetensors"), metadata={"format": "pt"})
    return d_text, d_mm, hf.model.embed_tokens_per_layer.weight.detach().clone()


def _config(path, additional):
    """vLLM's engine config of the checkpoint at ``path`` with ``additional`` as its additional config."""
    from conftest import vllm_config
    from vllm.config import CompilationConfig, ModelConfig, SchedulerConfig

    mc = ModelConfig(model=str(path), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                     limit_mm_per_prompt={"image": 0, "audio": 0} if "mm" in str(path) else None,
                     max_model_len=256)
    return vllm_config(model_config=mc, compilation_config=CompilationConfig(custom_ops=["none"]),
                       scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8,
                                                        max_model_len=256, is_encoder_decoder=False),
                       additional_config=additional)


def _build(path, additional):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    vc = _config(path, additional)
    with set_current_vllm_config(vc):
        return get_model(vllm_config=vc), vc


def _refused_by_the_config(path, additional, match: str) -> PluginConfigError:
    """vLLM's config of ``path`` with ``additional`` refused by the plugin's settings check, which vLLM runs as it
    builds the config (no model built): pydantic reports the plugin's error as a ValidationError of VllmConfig
    that carries it. Returns the plugin's error."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match) as e:
        _config(path, additional)
    err = e.value.errors()[0]["ctx"]["error"]
    assert isinstance(err, PluginConfigError) and re.search(match, str(err)), e.value
    return err


IDS = torch.tensor([0, 5, PLE_VOCAB - 1, PLE_VOCAB, VOCAB - 1, -1, 100, 2, 2])  # ids >= the PLE vocab read row 0


def test_get_per_layer_input_embeddings_is_vllms_bit_for_bit(checkpoints):
    assert register()
    d_text, _, table = checkpoints
    ref, _ = _build(d_text, {})
    ours, vc = _build(d_text, {"uvaple": {"shared": False}})
    assert isinstance(ref, UvapleGemma3nForCausalLM)  # registered, and vLLM's model exactly when not enabled
    stock = ref.model.self_decoder.embed_tokens_per_layer
    layer = ours.model.self_decoder.embed_tokens_per_layer
    assert not isinstance(stock.quant_method, UvapleEmbeddingMethod)
    assert isinstance(layer.quant_method, UvapleEmbeddingMethod)
    with pytest.raises(RuntimeError, match="lookups only.*tied LM head"):  # never a linear layer
        layer.quant_method.apply(layer, torch.zeros(2, 4))
    shard = layer.quant_method.shard
    assert layer.weight.device.type == "cpu" and layer.weight.data_ptr() == shard.table.ptr
    assert torch.equal(bits(shard.table.tensor[:PLE_VOCAB]), bits(table))  # the checkpoint's rows, exactly
    g = torch.Generator().manual_seed(1)
    for ids in (IDS, IDS[:1], torch.randint(-5, VOCAB + 5, (MAX_TOKENS,), generator=g)):
        want = ref.model.get_per_layer_input_embeddings(ids)
        got = ours.model.get_per_layer_input_embeddings(ids)
        assert got.shape == want.shape == (ids.numel(), LAYERS * 256) and got.dtype == want.dtype
        assert torch.equal(bits(got), bits(want))


def test_embed_input_ids_fills_the_same_buffer(checkpoints):
    assert register()
    _, d_mm, table = checkpoints
    ref, _ = _build(d_mm, {})
    ours, _ = _build(d_mm, {"uvaple": {"shared": False}})
    layer = ours.language_model.model.self_decoder.embed_tokens_per_layer
    assert isinstance(layer.quant_method, UvapleEmbeddingMethod)
    assert torch.equal(bits(layer.quant_method.shard.table.tensor[:PLE_VOCAB]), bits(table))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(-3, VOCAB + 3, (MAX_TOKENS - 5,), generator=g)
    for m in (ref, ours):
        m.per_layer_embeddings.fill_(float("nan"))  # poisoned: every row read must be written
    a = ref.embed_input_ids(ids)
    b = ours.embed_input_ids(ids)
    assert torch.equal(bits(a), bits(b))  # the token embeddings (vLLM's, in both)
    n = ids.numel()
    assert torch.equal(bits(ours.per_layer_embeddings[:n]), bits(ref.per_layer_embeddings[:n]))
    assert not torch.isnan(ours.per_layer_embeddings[:n]).any()


def test_a_bad_config_is_named_as_vllm_builds_its_config(checkpoints):
    assert register()
    d_text, d_mm, _ = checkpoints
    # refused as vLLM builds its config (in `vllm serve`, the API server's process, before any engine core)
    for path in (d_text, d_mm):
        for bad, match in [({"uvaple": {"placment": "uva"}}, "unknown key"),
                           ({"uvaple": {"placement": "gpu"}}, "placement: expected one of"),
                           ({"uvaple": {"timeout_s": -1}}, "positive number"),
                           ({"uvaple": "on"}, "object of settings")]:
            _refused_by_the_config(path, bad, match)
    assert _config(d_text, {"uvaple": {"placement": "uva"}}).additional_config == {"uvaple": {"placement": "uva"}}


def test_dedup_and_a_hot_set_give_vllms_bits(checkpoints, tmp_path):
    """The token-id levers through vLLM's loader: dedup and a hot set ranked on a file of token ids. The
    lookups read the most frequent rows from the set and give vLLM's bits, decode- and prefill-sized."""
    import numpy as np

    from uvaple.kernels import tuning

    assert register()
    d_text, _, _ = checkpoints
    profile = tmp_path / "ids.npy"
    np.save(profile, np.array([7] * 30 + [300] * 20 + [11] * 10 + [VOCAB - 1] * 50 + list(range(40))))
    ref, _ = _build(d_text, {})
    ours, _ = _build(d_text, {"uvaple": {"shared": False, "dedup": True, "hot_cache_gb": 0.001,
                                         "hot_profile": str(profile)}})
    lk = ours.model.self_decoder.embed_tokens_per_layer.quant_method.lookup
    assert lk.dedup and lk.hot is not None
    held = set(lk.hot.held[: lk.hot.size].tolist())
    assert {7, 300, 11} <= held and held <= set(range(PLE_VOCAB))  # ids past the PLE vocabulary hold nothing
    g = torch.Generator().manual_seed(3)
    for ids in (IDS, torch.randint(-5, VOCAB + 5, (MAX_TOKENS,), generator=g), torch.tensor([7, 7, 300, 11] * 16)):
        want = ref.model.get_per_layer_input_embeddings(ids)
        got = ours.model.get_per_layer_input_embeddings(ids)
        assert torch.equal(bits(got), bits(want))
    assert lk.stats()["hot_hits"] > 0
    assert MAX_TOKENS < tuning.dedup_min_ids(hot=True)  # these calls are direct; the sorted ones: tests/


def test_the_hot_set_is_refused_outside_the_uva_placement(checkpoints, tmp_path):
    assert register()
    d_text, _, _ = checkpoints
    profile = tmp_path / "ids.txt"
    profile.write_text("1 2 3")
    _refused_by_the_config(d_text, {"uvaple": {"placement": "device", "hot_cache_gb": 1,
                                               "hot_profile": str(profile)}},
                           "a hot set stands in front of .*placement \\['uva'\\]")
