"""The Gemma 3n swap-in serving its PLE table as fp8 rows (``backend_options={"quantize": "fp8_row"}``).

The definition: HF's module output for every row (``embedding * embed_scale.to(dtype)``) quantised by
``fp8_row_table``, then vLLM's formula ``codes.to(dtype) * row_scale.to(dtype)`` on the stored codes and
scales. The module must give exactly those bits, in the model's dtype, on every placement that takes the
option, with and without a hot set; its error report is the quantiser's; a bad value is named.
"""

from __future__ import annotations

import pytest
import torch
from helpers import bits

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'uvaple[hf]')")
from test_gemma3n import VOCAB, VOCAB_PLE, build_reference, patched_copy, ple_table, prompts  # noqa: E402
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextScaledWordEmbedding  # noqa: E402

from uvaple.integration.embedding import QUANTIZE, HostScaledEmbedding  # noqa: E402
from uvaple.integration.quantize import fp8_row_table  # noqa: E402
from uvaple.uva import HostTable  # noqa: E402

ROWS, COLS = 97, 48


def hf_embedding(dtype, device, *, scale=16 ** 0.5 * 4, seed=3, rows=ROWS, cols=COLS):
    torch.manual_seed(seed)
    hf = Gemma3nTextScaledWordEmbedding(rows, cols, 0, embed_scale=scale).to(dtype)
    hf.weight.data.normal_(0.0, 1.0)
    return hf.to(device)


def formula(hf, fmt, out_dtype):
    """vLLM's formula on the codes and scales of fp8_row_table(HF's output for every row): [rows, cols]."""
    with torch.no_grad():
        served = hf(torch.arange(hf.num_embeddings, device=hf.weight.device)).cpu()
    table, err = fp8_row_table(served, fmt, out_dtype=out_dtype)
    with table:
        stored = table.tensor
        cols = stored.shape[1] - 4
        codes = stored[:, :cols]
        scale = stored.view(torch.uint8)[:, cols:].contiguous().view(torch.float32)  # [rows, 1]
        return codes.to(out_dtype) * scale.to(out_dtype), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("backend", ["uva", "device"])
@pytest.mark.parametrize("quantize", sorted(QUANTIZE))
def test_module_output_is_the_formula_on_the_quantised_rows(device, dtype, backend, quantize):
    hf = hf_embedding(dtype, device, scale=2048 ** 0.5)  # not a power of two: rounded to dtype, as HF does
    mod = HostScaledEmbedding.from_embedding(hf, backend=backend, backend_options={"quantize": quantize})
    ids = torch.tensor([[0, 96, 97, 1000, -1, 7, 2**40], [5, 5, 5, 3, 95, 1, 2]], device=device)
    got = mod(ids)
    want, err = formula(hf, QUANTIZE[quantize], dtype)
    safe = torch.where((ids >= 0) & (ids < ROWS), ids, 0).cpu()  # oob="row0": row 0, as transformers
    assert got.dtype == dtype and got.device == ids.device and got.shape == (2, 7, COLS)
    assert torch.equal(bits(got.cpu()), bits(want[safe]))
    assert mod.quant_error.summary() == err.summary()
    assert torch.equal(mod.quant_error.max_abs, err.max_abs) and torch.equal(mod.quant_error.max_rel, err.max_rel)
    qt = mod.quantized_table
    assert qt.dtype == QUANTIZE[quantize] and (qt.rows, qt.cols) == (ROWS, COLS + 4)
    assert torch.equal(mod.weight, hf.weight.detach().cpu())  # the host table keeps the model's rows
    assert f"quantize={quantize}" in repr(mod)
    if backend == "device" and device.type == "cuda":
        assert mod.lookups[0].device_bytes() == qt.rows * qt.cols  # fp8 rows in HBM
    mod.close()
    assert qt.closed


def test_a_hot_set_holds_fp8_rows_and_keeps_the_bits(device):
    hf = hf_embedding(torch.bfloat16, device, seed=4)
    fp8 = HostScaledEmbedding.from_embedding(hf, backend_options={"quantize": "fp8_row"})
    hot = HostScaledEmbedding.from_embedding(hf, backend_options={
        "quantize": "fp8_row", "hot_fraction": 0.1, "hot_profile": torch.tensor([3, 3, 5, 9, 9, 9]),
        "order": "sorted", "dedup": True, "max_rows": 64})
    ids = torch.tensor([3, 5, 9, 11, 3, 3, 96, 200], device=device)
    assert torch.equal(bits(hot(ids)), bits(fp8(ids)))
    (hs,) = hot.hot_sets
    assert hs.table is hot.quantized_table and hs.rows.dtype == torch.float8_e4m3fn
    assert set(hs.held[: hs.size].tolist()) == {3, 5, 9}
    assert hot.lookups[0].stats()["hot_hits"] == 5
    fp8.close()
    hot.close()


def test_the_option_follows_backend_changes_dtype_moves_and_new_weights(device):
    hf = hf_embedding(torch.float32, device, seed=5, scale=4.0)
    mod = HostScaledEmbedding.from_embedding(hf, backend_options={"quantize": "fp8_row"})
    ids = torch.randint(0, ROWS, (2, 9), generator=torch.Generator().manual_seed(6)).to(device)
    want, _ = formula(hf, torch.float8_e4m3fn, torch.float32)
    assert torch.equal(bits(mod(ids).cpu()), bits(want[ids.cpu()]))
    first = mod.quantized_table
    mod.set_backend("device", {"quantize": "fp8_row"})  # same rows: the quantised table is reused
    assert mod.quantized_table is first and torch.equal(bits(mod(ids).cpu()), bits(want[ids.cpu()]))
    mod.set_backend("uva")  # lossless again: HF's bits, the quantised table released
    assert mod.quantized_table is None and mod.quant_error is None and first.closed
    assert torch.equal(mod(ids), hf(ids))
    mod.set_backend("uva", {"quantize": "fp8_row_e5m2"})
    e5m2, _ = formula(hf, torch.float8_e5m2, torch.float32)
    assert torch.equal(bits(mod(ids).cpu()), bits(e5m2[ids.cpu()]))
    mod.to(torch.bfloat16)  # the model's dtype: the output follows, the error is measured in it
    half, err = formula(hf, torch.float8_e5m2, torch.bfloat16)
    assert mod(ids).dtype == torch.bfloat16 and torch.equal(bits(mod(ids).cpu()), bits(half[ids.cpu()]))
    assert mod.quant_error.summary() == err.summary()
    with torch.no_grad():
        hf.weight.mul_(-2.0)
    mod.load_weight_(hf.weight)  # new rows: quantised again
    again, _ = formula(hf, torch.float8_e5m2, torch.bfloat16)
    assert torch.equal(bits(mod(ids).cpu()), bits(again[ids.cpu()]))
    mod.close()


def test_bad_values_are_named(device):
    hf = hf_embedding(torch.bfloat16, device, seed=7)
    for bad in ("int4", "fp8", 8, True):
        with pytest.raises(ValueError, match=r"backend_options\['quantize'\] must be one of"):
            HostScaledEmbedding.from_embedding(hf, backend_options={"quantize": bad})
    with pytest.raises(ValueError, match=r"quantize.*not 'copy'"):
        HostScaledEmbedding.from_embedding(hf, backend="copy", backend_options={"quantize": "fp8_row"})
    mod = HostScaledEmbedding.from_embedding(hf)
    ids = torch.arange(5, device=device)
    want = mod(ids).clone()
    kept = list(mod.lookups)
    with pytest.raises(ValueError, match=r"quantize.*not 'copy'"):
        mod.set_backend("copy", {"quantize": "fp8_row"})
    with pytest.raises(ValueError, match="must be one of"):
        mod.set_backend("uva", {"quantize": "nvfp4"})
    assert mod.lookups == kept and mod.backend_kind == "uva" and torch.equal(mod(ids), want)
    mod.close()
    with HostTable.from_tensor(torch.randint(-5, 5, (10, 8), dtype=torch.int8)) as t:
        ints = HostScaledEmbedding(10, 8, table=t, backend_options={"quantize": "fp8_row"})
        with pytest.raises(TypeError, match="needs a bf16, fp16 or fp32 table"):
            ints(torch.arange(3, device=device))


def test_patched_model_serves_fp8_rows_in_the_models_dtype(device):
    ref = build_reference(torch.bfloat16, device=device)
    model, patch = patched_copy(ref, backend_options={"quantize": "fp8_row"})
    mod = ple_table(model)
    ids = prompts(device, shape=(2, 9), seed=17)
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
        per_layer, stock = mod(ids), ref.model.embed_tokens_per_layer(ids)
    table, _ = formula(ref.model.embed_tokens_per_layer, torch.float8_e4m3fn, torch.bfloat16)
    assert per_layer.dtype == torch.bfloat16 and torch.equal(bits(per_layer.cpu()), bits(table[ids.cpu()]))
    assert got.dtype == want.dtype and got.isfinite().all()
    assert not torch.equal(per_layer, stock)  # quantised rows: close, not the same
    assert (got.float() - want.float()).abs().max() < 0.1 * want.float().abs().max()
    assert mod.quant_error.summary()["max_rel"] <= 2.0 ** -4 + 2.0 ** -8  # e4m3's bound, plus bf16's rounding
    sd = model.state_dict()["model.embed_tokens_per_layer.weight"]
    assert torch.equal(sd, ref.model.embed_tokens_per_layer.weight.cpu())  # checkpoints keep the bf16 rows
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, suppress_tokens=list(range(VOCAB_PLE, VOCAB)))
    assert model.generate(ids[:, :5], **kw).shape == (2, 8)
    patch.revert()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
