"""Qwen4Exp n-gram PLE: the plugin's table against vLLM's ``Qwen4ExpPLEDeviceEmbedding``, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import bits, rand
from safetensors.torch import save_file
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEDeviceEmbedding,
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
    Qwen4ExpPLEUnquantizedEmbeddingMethod,
)

from uvaple.integration.models.vllm import _build, config, qwen4_exp
from uvaple.integration.models.vllm.qwen4_exp import UvaplePLEEmbedding
from uvaple.integration.models.vllm.tables import PluginLoadError

METHODS = {"bf16": Qwen4ExpPLEUnquantizedEmbeddingMethod, "fp8": Qwen4ExpPLEFp8EmbeddingMethod}
HEADS, DIM, VOCAB, MAX_TOKENS = 4, 160, 1000, 24  # fp8 rows of 160 B, as the model's


def ctx(**cfg) -> _build.BuildContext:
    return _build.BuildContext(cfg=config.PluginConfig(**dict(dict(shared=False), **cfg)), identity="t" * 64,
                               device=torch.device("cpu"), check_loaded=True, max_tokens=MAX_TOKENS)


def pair(kind: str, seed: int, scale: float = 0.0173, **cfg):
    """vLLM's device table and the plugin's, loaded with the same random weights through their loaders."""
    kw = dict(params_dtype=torch.bfloat16, padding_size=64, prefix=f"m.{kind}.{seed}")
    ref = Qwen4ExpPLEDeviceEmbedding(VOCAB, DIM, embedding_method=METHODS[kind](), **kw)
    with _build.building(ctx(**cfg), []):
        ours = UvaplePLEEmbedding(VOCAB, DIM, embedding_method=METHODS[kind](), num_ngram_heads=HEADS,
                                  max_total_tokens=MAX_TOKENS, **kw)
    w = rand(VOCAB, DIM, torch.float32, seed).to(ref.weight.dtype)
    for layer in (ref, ours):
        layer.weight.weight_loader(layer.weight, w)
        if kind == "fp8":
            layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(scale))
    ours.uvaple_finish_loading()
    return ref, ours, w


def run(layer, ids):
    return layer.dequantize(layer(ids), torch.bfloat16)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_rows_are_vllms_bit_for_bit(kind):
    ref, ours, _ = pair(kind, seed=1)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, VOCAB, (MAX_TOKENS, HEADS), generator=g),  # the maximum batch
               torch.randint(0, VOCAB, (1, HEADS), generator=g),  # one token
               torch.tensor([[0, VOCAB - 1, 1, VOCAB - 2]]),  # the table's ends
               torch.randint(0, VOCAB, (5, HEADS), generator=g).to(torch.int32)]
    for ids in batches:
        out = run(ours, ids)
        assert out.shape == (ids.shape[0], HEADS, DIM) and out.dtype == torch.bfloat16
        assert torch.equal(bits(out), bits(run(ref, ids))), ids.shape


@pytest.mark.parametrize("scale", [0.0173, -2.5, 1e-30, 3.0e38, 448.0])
def test_fp8_dequantises_in_the_kernel_with_vllms_formula(scale):
    ref, ours, w = pair("fp8", seed=2, scale=scale)
    ids = torch.randint(0, VOCAB, (MAX_TOKENS, HEADS), generator=torch.Generator().manual_seed(3))
    raw = ours(ids)
    assert raw.dtype == torch.bfloat16  # dequantised by the kernel: vLLM's dequantize step is the identity
    assert torch.equal(bits(ours.dequantize(raw, torch.bfloat16)), bits(raw))
    want = w[ids].to(torch.bfloat16) * torch.tensor([scale], dtype=torch.float32).to(torch.bfloat16)
    assert torch.equal(bits(raw), bits(want))
    assert torch.equal(bits(raw), bits(run(ref, ids)))
    with pytest.raises(RuntimeError, match="rounds in the output dtype"):
        ours.dequantize(raw, torch.float16)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_ids_outside_the_table_give_zero_rows(kind):
    """vLLM's device table faults on them; the plugin's reads nothing outside the table."""
    _, ours, w = pair(kind, seed=4)
    ids = torch.tensor([[VOCAB, 1023, 1024, -1], [2**40, -(2**63), 2**63 - 1, 5]])
    out = ours(ids)
    assert torch.equal(bits(out[0]), bits(torch.zeros(HEADS, DIM, dtype=out.dtype)))
    assert torch.equal(bits(out[1, :3]), bits(torch.zeros(3, DIM, dtype=out.dtype)))
    assert torch.equal(bits(out[1, 3]), bits(run(pair(kind, seed=4)[0], torch.tensor([[5]]))[0, 0]))


def test_copy_placement_gives_the_same_bits_and_leaves_fp8_to_vllm():
    for kind in ("bf16", "fp8"):
        ref, ours, _ = pair(kind, seed=5, placement="copy")
        ids = torch.randint(0, VOCAB, (MAX_TOKENS, HEADS), generator=torch.Generator().manual_seed(6))
        if kind == "fp8":
            assert ours(ids).dtype == torch.float8_e4m3fn  # rows as stored, vLLM's method dequantises
        assert torch.equal(bits(run(ours, ids)), bits(run(ref, ids)))
        ours._uvaple_lookup.close()


@pytest.mark.parametrize("kind,quantize", [("bf16", "none"), ("fp8", "none"), ("bf16", "fp8_row")])
def test_the_disk_placement_serves_the_host_tables_bits_from_a_table_file(tmp_path, kind, quantize):
    """placement disk: vLLM's loader writes the staging file, the layer's first lookup writes the table file, and
    the rows are the uva placement's (vLLM's own for bf16 and fp8; the encoding's for fp8_row), ids outside the
    table zero rows; a second layer of the same checkpoint reuses the file."""
    ids = torch.randint(0, VOCAB, (MAX_TOKENS, HEADS), generator=torch.Generator().manual_seed(41))
    ids[0] = torch.tensor([0, VOCAB - 1, VOCAB, -1])
    _, host, _ = pair(kind, seed=40, quantize=quantize)
    want = run(host, ids)
    for n in range(2):
        _, disk, _ = pair(kind, seed=40, quantize=quantize, placement="disk", disk_dir=str(tmp_path),
                          disk_cache_gb=0.01)
        shard = disk._uvaple_shard
        assert shard.placement == "disk" and shard.fills == (n == 0)
        assert torch.equal(bits(run(disk, ids)), bits(want))
        assert [f for f in os.listdir(tmp_path) if f.endswith(".uvt")] == [os.path.basename(shard.path)]
        disk._uvaple_lookup.close()
        shard.close()


def test_fp8_row_quantises_on_load_and_dequantises_in_the_kernel():
    """quantize fp8_row on a bf16 checkpoint: vLLM's loader hands the plugin bf16 rows, the shard holds the
    registry's fp8_row bytes, and the layer returns bf16 rows equal to the encoding's reference (vLLM's
    unquantised dequantize is then the identity); the device placement holds the same table in HBM."""
    from uvaple.kernels.encodings import ENCODINGS, quantize_fp8_rows

    _, ours, w = pair("bf16", seed=31, quantize="fp8_row")
    shard = ours._uvaple_shard
    assert shard.encoding == "fp8_row" and shard.table.shape == (1024, DIM + 4)
    assert ours.weight.shape == (1024, DIM) and ours.weight.dtype == torch.float8_e4m3fn  # the codes' view
    q = quantize_fp8_rows(w)
    assert torch.equal(bits(shard.table.tensor[:VOCAB]), bits(q))
    ids = torch.randint(0, VOCAB, (MAX_TOKENS, HEADS), generator=torch.Generator().manual_seed(32))
    ids[0] = torch.tensor([0, VOCAB - 1, VOCAB, -1])  # the ends, and two ids outside: zero rows
    out = run(ours, ids)
    assert out.dtype == torch.bfloat16 and out.shape == (MAX_TOKENS, HEADS, DIM)
    want = ENCODINGS["fp8_row"].dequantise(q[ids.clamp(0, VOCAB - 1).reshape(-1)], torch.bfloat16).reshape(out.shape)
    want[0, 2:] = 0
    assert torch.equal(bits(out), bits(want))
    _, dev, _ = pair("bf16", seed=31, quantize="fp8_row", placement="device")
    assert torch.equal(bits(run(dev, ids)), bits(out))


def test_fp8_row_on_an_fp8_checkpoint_is_refused():
    with _build.building(ctx(quantize="fp8_row"), []), pytest.raises(config.PluginConfigError,
                                                                      match="quantize fp8_row quantises a bf16"):
        UvaplePLEEmbedding(VOCAB, DIM, params_dtype=torch.bfloat16, padding_size=64, prefix="q",
                           embedding_method=Qwen4ExpPLEFp8EmbeddingMethod())


def test_fp8_row_with_dummy_weights_needs_no_fp16_copy_of_the_table():
    """load_format="dummy": vLLM's loader fills a parameter with its dummy_weight_value when it has one (an fp8
    parameter would otherwise go through an fp16 temporary of its size); the rows are then drawn as vLLM draws a
    bf16 dummy table's."""
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    from uvaple.integration.models.vllm.tables import DUMMY_CODE

    kw = dict(params_dtype=torch.bfloat16, padding_size=64, prefix="m.dummy")
    c = _build.BuildContext(cfg=config.PluginConfig(shared=False, quantize="fp8_row"), identity="d" * 64,
                            device=torch.device("cpu"), check_loaded=False, max_tokens=MAX_TOKENS)
    with _build.building(c, []):
        ours = UvaplePLEEmbedding(VOCAB, DIM, embedding_method=METHODS["bf16"](), num_ngram_heads=HEADS,
                                  max_total_tokens=MAX_TOKENS, **kw)
    assert ours.weight.dummy_weight_value == DUMMY_CODE
    initialize_single_dummy_weight(ours.weight, name="weight")
    assert torch.equal(ours.weight.float(), torch.full(ours.weight.shape, DUMMY_CODE))  # no fp16 copy was made
    ours.uvaple_finish_loading()
    out = run(ours, torch.tensor([[0, 5, VOCAB - 1, 17]]))
    assert out.abs().max() <= 1.01e-3 and len(torch.unique(out)) > 50  # rows drawn as vLLM's dummy bf16 rows


def test_the_weight_is_the_host_table_and_nothing_else_holds_the_rows():
    _, ours, w = pair("fp8", seed=8)
    shard = ours._uvaple_shard
    assert ours.weight.device.type == "cpu" and ours.weight.data_ptr() == shard.table.ptr
    assert ours.weight.shape == (1024, DIM) and shard.table.rows == 1024  # vLLM's padded shard, exact size
    assert torch.equal(bits(shard.table.tensor[:VOCAB]), bits(w))
    big = [n for n, t in list(ours.named_parameters()) + list(ours.named_buffers())
           if t.numel() >= VOCAB and t.data_ptr() != shard.table.ptr]
    assert big == []


def _ngram_config(**kw):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(vocab_size=300, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=250,
                              make_ngram_vocab_size_divisible_by=128, eos_token_id=1, split_ngram_parts=3,
                              ple_embed_dim=4 * DIM, **kw)


def _ngram(plugin: bool, quant: str | None, **cfg):
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    conf = _ngram_config(**({"ple_embedding_dtype": quant} if quant else {}))
    args = dict(config=conf, embedding_dim=4 * DIM, ple_dense_layer_id=0, max_total_tokens=MAX_TOKENS,
                data_parallel_rank=0, prefix="model.layers.0.ple.ple_embedding", params_dtype=torch.bfloat16)
    if not plugin:
        return Qwen4ExpNGramEmbedding(**args)
    with _build.building(ctx(**cfg), qwen4_exp._swaps()):
        return Qwen4ExpNGramEmbedding(**args)


@pytest.mark.parametrize("quant", [None, "float8_e4m3fn"])
@pytest.mark.parametrize("layout", ["whole", "shards"])
def test_vllms_loader_streams_a_safetensors_file_into_the_table(tmp_path, quant, layout):
    """The model's own n-gram module and load_weights, from a safetensors file through vLLM's iterator:
    the rows land in the host table bit-exact, and the full forward (ids hashed from tokens) is vLLM's."""
    ref, ours = _ngram(False, quant), _ngram(True, quant)
    assert type(ref.ngram_embedding) is Qwen4ExpPLEDeviceEmbedding
    assert type(ours.ngram_embedding) is UvaplePLEEmbedding
    emb = ours.ngram_embedding
    rows = emb.org_vocab_size
    dtype = torch.float8_e4m3fn if quant else torch.bfloat16
    w = rand(rows, DIM, torch.float32, seed=11).to(dtype)
    tensors = {}
    if layout == "whole":
        tensors["ngram_embedding.weight"] = w
    else:
        size = -(-rows // 3)
        for i in range(3):
            tensors[f"ngram_embedding.shard_{i}.weight"] = w[i * size:(i + 1) * size].contiguous()
    if quant:
        tensors["ngram_embedding.weight_scale"] = torch.tensor(0.031, dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    for m in (ref, ours):
        loaded = m.load_weights(safetensors_weights_iterator([str(path)], use_tqdm_on_load=False))
        assert "ngram_embedding.weight" in loaded
    emb.uvaple_finish_loading()
    assert torch.equal(bits(emb._uvaple_shard.table.tensor[:rows]), bits(w))
    assert emb.weight.data_ptr() == emb._uvaple_shard.table.ptr
    tokens = torch.randint(0, 300, (19,), generator=torch.Generator().manual_seed(12))
    qsl = torch.tensor([0, 7, 8, 19])
    context = torch.randint(0, 300, (3, 2), generator=torch.Generator().manual_seed(13))
    hidden = torch.zeros(19, 8)
    a = ref(hidden, tokens, qsl, context)
    b = ours(hidden, tokens, qsl, context)
    assert torch.equal(bits(ref.ngram_embedding.dequantize(a, torch.bfloat16)),
                       bits(emb.dequantize(b, torch.bfloat16)))


def test_a_checkpoint_missing_rows_is_a_named_error(tmp_path):
    ours = _ngram(True, None)
    rows = ours.ngram_embedding.org_vocab_size
    size = -(-rows // 3)
    w = rand(size, DIM, torch.bfloat16, seed=14)
    save_file({"ngram_embedding.shard_0.weight": w}, str(tmp_path / "m.safetensors"))
    ours.load_weights(safetensors_weights_iterator([str(tmp_path / "m.safetensors")], use_tqdm_on_load=False))
    with pytest.raises(PluginLoadError, match=f"left {rows - size} of {rows} rows"):
        ours.ngram_embedding.uvaple_finish_loading()


def test_a_table_of_the_wrong_shape_is_a_named_error():
    _, ours, _ = pair("bf16", seed=15)
    with pytest.raises(PluginLoadError, match="expects"):
        ours.weight.weight_loader(ours.weight, torch.zeros(VOCAB + 1, DIM, dtype=torch.bfloat16))
    with pytest.raises(PluginLoadError, match="do not fit"):
        ours.weight.weight_loader(ours.weight, torch.zeros(10, DIM + 1, dtype=torch.bfloat16), checkpoint_start=0)


def test_nvfp4_and_layers_outside_a_plugin_build_are_refused():
    with _build.building(ctx(), []), pytest.raises(config.PluginConfigError, match="not supported"):
        UvaplePLEEmbedding(VOCAB, DIM, params_dtype=torch.bfloat16, padding_size=64, prefix="n",
                           embedding_method=Qwen4ExpPLENvFp4EmbeddingMethod())
    with pytest.raises(RuntimeError, match="built by the plugin's model classes"):
        UvaplePLEEmbedding(VOCAB, DIM, params_dtype=torch.bfloat16, padding_size=64, prefix="n",
                           embedding_method=Qwen4ExpPLEUnquantizedEmbeddingMethod())


def test_the_swap_is_scoped():
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as ngram

    before = (ngram.Qwen4ExpPLEDeviceEmbedding, ngram.Qwen4ExpPLEPinnedHostEmbedding)
    with pytest.raises(ZeroDivisionError), _build.building(ctx(), qwen4_exp._swaps()):
        assert ngram.Qwen4ExpPLEDeviceEmbedding is UvaplePLEEmbedding
        1 / 0  # noqa: B018 - a failing build restores vLLM's classes
    assert (ngram.Qwen4ExpPLEDeviceEmbedding, ngram.Qwen4ExpPLEPinnedHostEmbedding) == before
    assert type(_ngram(False, None).ngram_embedding) is Qwen4ExpPLEDeviceEmbedding
