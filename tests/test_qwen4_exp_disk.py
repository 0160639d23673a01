"""Qwen4Exp with its n-gram tables in table files (``backend="disk"``): transformers' own bits over a prefill and
decode steps from a cache too small to hold a table, for a loaded checkpoint (bf16, quantised to fp8_row on the way,
an fp8 checkpoint as stored) and a live model; the files written once and reused while the checkpoint is the same,
written again when it changes; one read round a forward for every layer's misses, with the bits and counts of
reading layer by layer; every missing option, a disk too small and a model that writes no files named before any
work. The tiny model and its checkpoint are ``tests/test_qwen4_exp.py``'s."""

from __future__ import annotations

import copy
import os
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'uvaple[hf]')")
pytest.importorskip("transformers.models.qwen4_exp", reason="this transformers has no Qwen4Exp (5.17 or later)")
from helpers import bits  # noqa: E402
from test_qwen4_exp import (  # noqa: E402
    assert_same_steps,
    build_reference,
    fp8_checkpoint,
    ngram_modules,
    prompts,
    run_steps,
)
from transformers import CompileConfig, Qwen4ExpForCausalLM  # noqa: E402

from uvaple.integration.file_embedding import FileEmbedding  # noqa: E402
from uvaple.integration.models import hf, ngram_tables  # noqa: E402
from uvaple.integration.models.qwen4_exp import apply_uvaple_to_qwen4_exp, load_qwen4_exp_with_host_ple  # noqa: E402
from uvaple.kernels.encodings import quantize_fp8_rows  # noqa: E402
from uvaple.uva import TableFile, TableFileError  # noqa: E402

SLOTS = 48  # rows each layer's cache holds: fewer than the rows a prefill and four decode steps read, so steps evict
MAX_TOKENS = 12  # tokens a forward brings at most: 48 rows (4 heads a token), as many as a cache holds
STEPS = 4


@pytest.fixture(scope="module")
def ref():
    return build_reference()


@pytest.fixture(scope="module")
def checkpoint(ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp_disk") / "bf16"
    ref.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def want(checkpoint):
    """transformers' own model of the checkpoint: prefill and decode steps."""
    model = Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    return run_steps(model, prompts((2, 5), seed=7), STEPS)


def disk(folder, **options) -> dict:
    return dict(backend="disk", backend_options={"table_dir": str(folder), "slots": SLOTS, **options},
                max_tokens=MAX_TOKENS)


def files(folder) -> dict:
    """The table files in ``folder``: name -> inode (a file written again is a new inode: the writer renames)."""
    return {n: os.stat(os.path.join(folder, n)).st_ino for n in sorted(os.listdir(folder))}


def close(model) -> None:
    for mod in ngram_modules(model):
        mod.close()


def test_loaded_tables_are_files_served_with_transformers_bits_and_reused_while_the_checkpoint_is_the_same(
        checkpoint, want, tmp_path, caplog):
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path))
    written = files(tmp_path)
    assert list(written) == [f"qwen4_exp_ngram_layer{i:03d}_raw.uvtable" for i in range(3)]
    with TableFile.open(tmp_path / "qwen4_exp_ngram_layer002_raw.uvtable") as f:  # says what it was written from
        name = r"model\.layers\.\d+\.ple\.ple_embedding\.ngram_embedding\.shard_0\.weight"
        at = re.escape(os.path.realpath(checkpoint))
        want_source = rf"{name} and 2 more shard\(s\) of {at}/\S+ as raw; sha256:[0-9a-f]{{64}}"
        assert re.fullmatch(want_source, f.source), f.source
    for mod in ngram_modules(model):
        emb = mod.ngram_embedding
        assert isinstance(emb, FileEmbedding) and emb.encoding == "raw" and emb.max_tokens == MAX_TOKENS * 4
    assert not any(p.shape[-1] == 8 and p.shape[0] >= 240 for p in model.parameters())  # no table in memory
    with caplog.at_level("WARNING", logger="uvaple.integration.file_embedding"):
        assert not any("ngram_embedding.weight" in k for k in model.state_dict())  # a serving copy
        model.state_dict()  # said once a module
    said = [r.getMessage() for r in caplog.records if "is not in the state dict" in r.getMessage()]
    assert len(said) == 3 and "model.layers.0.ple.ple_embedding.ngram_embedding.weight is served from the table " \
                              "file" in said[0] and "save_pretrained" in said[0]
    got = run_steps(model, prompts((2, 5), seed=7), STEPS)
    assert_same_steps(got, want)
    stats = [mod.ngram_embedding.lookups[0].stats() for mod in ngram_modules(model)]
    assert all(s["slots"] == SLOTS and s["cache"]["evictions"] > 0 for s in stats)
    close(model)
    again = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path))
    assert files(tmp_path) == written  # opened as they were: nothing written
    assert_same_steps(run_steps(again, prompts((2, 5), seed=7), STEPS), want)
    close(again)


def test_a_checkpoint_written_again_has_its_files_written_again(checkpoint, want, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    load_qwen4_exp_with_host_ple(ckpt, dtype=torch.bfloat16, **disk(tmp_path / "t"))
    first = files(tmp_path / "t")
    shard = ckpt / "model.safetensors"
    os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns + 10**9))  # saved again
    model = load_qwen4_exp_with_host_ple(ckpt, dtype=torch.bfloat16, **disk(tmp_path / "t"))
    now = files(tmp_path / "t")
    assert list(now) == list(first) and all(now[n] != first[n] for n in now)
    assert_same_steps(run_steps(model, prompts((2, 5), seed=7), STEPS), want)
    close(model)


def test_fp8_tables_in_files_serve_the_host_tables_bits(ref, checkpoint, tmp_path):
    """Quantised on the way to the file (fp8_row), and an fp8 checkpoint's codes as stored (fp8_global): the same
    bits as the same encoding in host memory."""
    prompt = prompts((2, 5), seed=8)
    q = {"quantize": "fp8_row"}
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path / "q", **q))
    host = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, backend_options={**q, "keep_source": False})
    for mod, hf_mod in zip(ngram_modules(model), ngram_modules(ref), strict=True):
        emb = mod.ngram_embedding
        assert emb.encoding == "fp8_row"
        stored = emb.table.read_rows(torch.arange(emb.num_embeddings))
        assert torch.equal(stored.view(torch.uint8), quantize_fp8_rows(hf_mod.ngram_embedding.weight).view(torch.uint8))
    assert_same_steps(run_steps(model, prompt, 2), run_steps(host, prompt, 2))
    close(model)
    fp8_checkpoint(checkpoint, tmp_path / "fp8", quantization_config=False)
    model = load_qwen4_exp_with_host_ple(tmp_path / "fp8", dtype=torch.bfloat16, **disk(tmp_path / "g"))
    host = load_qwen4_exp_with_host_ple(tmp_path / "fp8", dtype=torch.bfloat16)
    assert [m.ngram_embedding.encoding for m in ngram_modules(model)] == ["fp8_global"] * 3
    assert list(files(tmp_path / "g"))[0] == "qwen4_exp_ngram_layer000_fp8_global.uvtable"
    for a, b in zip(ngram_modules(model), ngram_modules(host), strict=True):
        assert torch.equal(a.ngram_embedding.weight_scale, b.ngram_embedding.weight_scale)
    assert_same_steps(run_steps(model, prompt, 2), run_steps(host, prompt, 2))
    close(model)


def test_a_live_model_is_written_to_files_and_reverted_from_them(ref, tmp_path):
    model = copy.deepcopy(ref)
    children = ngram_modules(model)
    prompt = prompts((2, 5), seed=9)
    with apply_uvaple_to_qwen4_exp(model, **disk(tmp_path)) as patch:
        assert len(patch.modules) == 3 and all(isinstance(m, FileEmbedding) for m in patch.modules)
        assert all(c.ngram_embedding.weight.numel() == 0 for c in children)  # the tables in memory are freed
        assert_same_steps(run_steps(model, prompt, 2), run_steps(ref, prompt, 2))
        reads = ngram_modules(model)[0]._step_reads  # one read round a forward
        assert reads.stats == {"rounds": 3, "failed": 0, "taken": 9}
    assert reads._closed and all(getattr(m, "_step_reads", None) is None for m in ngram_modules(model))
    assert len(files(tmp_path)) == 3
    for a, b in zip(ngram_modules(model), ngram_modules(ref), strict=True):
        assert torch.equal(bits(a.ngram_embedding.weight), bits(b.ngram_embedding.weight))
    fp8 = copy.deepcopy(ref)
    with apply_uvaple_to_qwen4_exp(fp8, **disk(tmp_path / "q", quantize="fp8_row", keep_source=False)):
        with TableFile.open(tmp_path / "q" / "qwen4_exp_ngram_layer001_fp8_row.uvtable") as f:
            stored = f.read_rows(torch.arange(f.rows)).view(torch.uint8)
            w = ngram_modules(ref)[1].ngram_embedding.weight
            assert torch.equal(stored, quantize_fp8_rows(w).view(torch.uint8))
    got = ngram_modules(fp8)[1].ngram_embedding.weight  # the rows as served: the fp8_row formula
    codes, scale = stored[:, :-4].view(torch.float8_e4m3fn), stored[:, -4:].contiguous().view(torch.float32)
    assert torch.equal(bits(got), bits(codes.to(torch.bfloat16) * scale.to(torch.bfloat16)))


def test_a_failed_apply_leaves_every_table_as_it_was(ref, tmp_path, monkeypatch):
    """The third table cannot be written: the two written before give way, and no table was freed or rounded."""
    from uvaple.integration import file_embedding

    model = copy.deepcopy(ref)
    real, calls = file_embedding.write_table_file, []

    def failing(*a, **kw):
        calls.append(a[0])
        if len(calls) == 3:
            raise TableFileError("no space left on the disk (injected)")
        return real(*a, **kw)

    monkeypatch.setattr(file_embedding, "write_table_file", failing)
    with pytest.raises(TableFileError, match="injected"):
        apply_uvaple_to_qwen4_exp(model, **disk(tmp_path, quantize="fp8_row", keep_source=False))
    assert len(calls) == 3 and all(type(m).__name__ == "Qwen4ExpTextNGramEmbedding" for m in ngram_modules(model))
    for a, b in zip(ngram_modules(model), ngram_modules(ref), strict=True):
        assert torch.equal(bits(a.ngram_embedding.weight), bits(b.ngram_embedding.weight))


def test_a_revert_that_cannot_read_a_file_back_gives_back_the_others_and_names_it(ref, tmp_path):
    model = copy.deepcopy(ref)
    patch = apply_uvaple_to_qwen4_exp(model, **disk(tmp_path))
    damaged = tmp_path / "qwen4_exp_ngram_layer002_raw.uvtable"
    with open(damaged, "r+b") as f:  # one byte of data page 0 (the file's page 1) changed under the open table
        f.seek(4096 + 10)
        byte = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(TableFileError, match="data page 0 does not match its sum"):
        patch.revert()
    mods = ngram_modules(model)
    assert [type(m).__name__ for m in mods] == ["Qwen4ExpTextNGramEmbedding"] * 2 + ["HostNGramEmbedding"]
    for a, b in zip(mods[:2], ngram_modules(ref)[:2], strict=True):
        assert torch.equal(bits(a.ngram_embedding.weight), bits(b.ngram_embedding.weight))
    mods[2].close()


def test_a_file_is_written_again_for_another_checkpoint_with_the_same_times_and_per_fp8_format(ref, checkpoint,
                                                                                                tmp_path):
    load_qwen4_exp_with_host_ple(checkpoint, **disk(tmp_path / "t"))
    first = files(tmp_path / "t")
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    from safetensors.torch import load_file, save_file

    sd = load_file(other / "model.safetensors")
    save_file({k: -v if "ngram_embedding" in k else v for k, v in sd.items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    shutil.copystat(checkpoint / "model.safetensors", other / "model.safetensors")  # its times are the first's
    model = load_qwen4_exp_with_host_ple(other, dtype=torch.bfloat16, **disk(tmp_path / "t"))
    now = files(tmp_path / "t")
    assert all(now[n] != first[n] for n in now)  # written again
    emb = ngram_modules(model)[0].ngram_embedding
    assert torch.equal(bits(emb.read_table()), bits(-ngram_modules(ref)[0].ngram_embedding.weight))
    close(model)
    w = ngram_modules(ref)[0].ngram_embedding.weight
    for q, fmt in [("fp8_row", torch.float8_e4m3fn), ("fp8_row_e5m2", torch.float8_e5m2)]:
        model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path / "q", quantize=q))
        with TableFile.open(tmp_path / "q" / f"qwen4_exp_ngram_layer000_{q}.uvtable") as f:  # a file of each
            stored = f.read_rows(torch.arange(f.rows))
        assert torch.equal(stored.view(torch.uint8), quantize_fp8_rows(w, fmt).view(torch.uint8))
        close(model)


def test_every_missing_setting_is_named_before_any_work(ref, checkpoint, tmp_path, monkeypatch):
    model = copy.deepcopy(ref)
    folder = str(tmp_path / "never")
    for kw, match in [(dict(backend_options={"slots": SLOTS}, max_tokens=16), "give their folder as backend_options"),
                      (dict(backend_options={"table_dir": folder, "slots": SLOTS}), "pass max_tokens"),
                      (dict(backend_options={"table_dir": folder, "slots": SLOTS}, max_tokens=0),
                       "max_tokens must be a positive int"),
                      (dict(backend_options={"table_dir": folder}, max_tokens=16), "needs exactly one of budget_bytes"),
                      (dict(backend_options={"table_dir": folder, "slots": 63}, max_tokens=16),
                       "holds 63 rows of 16 B, and a call may bring 64 distinct rows: give budget_bytes >= 1024"),
                      (dict(backend_options={"table_dir": folder, "budget_byte": 1 << 20}, max_tokens=16),
                       "takes no option \\['budget_byte'\\]")]:
        with pytest.raises(ValueError, match=match):
            apply_uvaple_to_qwen4_exp(model, backend="disk", **kw)
        with pytest.raises(ValueError, match=match):
            load_qwen4_exp_with_host_ple(checkpoint, backend="disk", **kw)
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ValueError, match="table_dir'\\] '.*a_file' is a file, not a folder"):
        load_qwen4_exp_with_host_ple(checkpoint, backend="disk", backend_options={"table_dir": str(tmp_path / "a_file"),
                                                                                  "slots": SLOTS}, max_tokens=16)
    assert all(type(m).__name__ == "Qwen4ExpTextNGramEmbedding" for m in ngram_modules(model))  # untouched
    assert not os.path.exists(folder)  # nothing written
    with pytest.raises(ValueError, match="with quantize writes each table's fp8_row rows .*'keep_source'\\]=False"):
        apply_uvaple_to_qwen4_exp(model, **disk(tmp_path, quantize="fp8_row"))
    with pytest.raises(ValueError, match="not served by the class patch.*load_qwen4_exp_with_host_ple"):
        apply_uvaple_to_qwen4_exp(**disk(tmp_path))
    with pytest.raises(ValueError, match="table_dir'\\] is the folder of table files, which backend='uva' does not"):
        apply_uvaple_to_qwen4_exp(model, backend_options={"table_dir": folder})
    with pytest.raises(ValueError, match="backend must be one of \\('uva', 'device', 'copy', 'disk'\\), got 'dsik'"):
        apply_uvaple_to_qwen4_exp(model, backend="dsik")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # "~" is the user's folder, not a folder named "~"
    with apply_uvaple_to_qwen4_exp(model, **{**disk("~/tables"), "max_tokens": 2}) as patch:
        assert (tmp_path / "home" / "tables").is_dir() and not os.path.exists("~")
        with pytest.raises(ValueError, match="3 tokens in one forward, but this model's n-gram layers were built for "
                                             "max_tokens=2"):
            model(prompts((1, 3), seed=3))
        with pytest.raises(ValueError, match="modules are uvaple's already .* set_backend"):
            apply_uvaple_to_qwen4_exp(model, **disk(tmp_path))
        assert len(patch.modules) == 3
    with pytest.raises(ValueError, match="serves table files, which uvaple writes for the PLE tables of \\['qwen4"):
        hf.apply_uvaple(model_type="gemma3n_text", backend="disk")
    with pytest.raises(ValueError, match="serves table files.*use 'uva'"):
        hf.from_pretrained_with_host_tables(Qwen4ExpForCausalLM, checkpoint, model_type="gemma3n_text", backend="disk")
    free = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ngram_tables.shutil, "disk_usage", lambda p: free._replace(free=40 << 10))
    with pytest.raises(TableFileError, match="need 44.00 KiB more on its disk .*it has 40.00 KiB free"):
        load_qwen4_exp_with_host_ple(checkpoint, **disk(tmp_path / "small"))
    assert not (tmp_path / "small").exists() or not os.listdir(tmp_path / "small")  # nothing written
    monkeypatch.undo()
    close(load_qwen4_exp_with_host_ple(checkpoint, **disk(tmp_path / "t")))
    shard = checkpoint / "model.safetensors"
    st = os.stat(shard)
    monkeypatch.setattr(ngram_tables.shutil, "disk_usage", lambda p: free._replace(free=16 << 10))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the checkpoint saved again: every file stale
    try:  # each new file beside the one it replaces: the largest, 16 KiB, at most at once
        model = load_qwen4_exp_with_host_ple(checkpoint, **disk(tmp_path / "t"))
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    close(model)
    monkeypatch.setattr(ngram_tables.shutil, "disk_usage", lambda p: free._replace(free=(16 << 10) - 1))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    try:
        with pytest.raises(TableFileError, match="need 16.00 KiB more on its disk"):
            load_qwen4_exp_with_host_ple(checkpoint, **disk(tmp_path / "t"))
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.gpu
def test_gpu_a_model_on_the_gpu_serves_its_files_with_the_host_tables_bits(checkpoint, tmp_path):
    """On the GPU: every PLE layer's hashed ids copied to the host at once, read ahead from the files into the pinned
    caches in one round, and each layer gathered over UVA in the model's stream; the same bits as the tables in host
    memory over the same steps."""
    prompt = prompts((2, 5), seed=11).cuda()
    host = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16).cuda()
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path)).cuda()
    assert all(m.ngram_embedding.lookups[0].device.type == "cuda" for m in ngram_modules(model))  # built on .cuda()
    assert_same_steps(run_steps(model, prompt, STEPS), run_steps(host, prompt, STEPS))
    assert all(m.ngram_embedding.lookups[0].stats()["cache"]["evictions"] > 0 for m in ngram_modules(model))
    # one round a forward: the ids of every layer copied to pinned memory at once, each layer's call from them
    assert reads_of(model).stats == {"rounds": STEPS + 1, "failed": 0, "taken": 3 * (STEPS + 1)}
    assert all(s["rows_ahead"] == s["cache"]["misses"] for s in
               (m.ngram_embedding.lookups[0].stats() for m in ngram_modules(model)))
    close(model)


@pytest.mark.gpu
def test_gpu_generate_compiled_by_transformers_with_a_static_cache_calls_the_files_eagerly(ref, tmp_path):
    """The user's path: generate with a static cache compiles the decode forward (mode="reduce-overhead"); each
    PLE layer's disk call runs eagerly between the captured parts (a graph break, never captured), and the tokens
    are eager generate's and the host tables'."""
    prompt = prompts((2, 6), seed=12).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    host = copy.deepcopy(ref).float().cuda()
    patch = apply_uvaple_to_qwen4_exp(host, max_tokens=64)
    want = host.generate(prompt, disable_compile=True, **kw)
    patch.revert()
    model = copy.deepcopy(ref).float().cuda()
    patch = apply_uvaple_to_qwen4_exp(model, **{**disk(tmp_path, slots=256), "max_tokens": 64})
    assert torch.equal(model.generate(prompt, disable_compile=True, **kw), want)
    torch._dynamo.reset()
    try:
        for run in range(2):  # compile and capture, then replay
            got = model.generate(prompt, compile_config=CompileConfig(fullgraph=False, mode="reduce-overhead"), **kw)
            assert hasattr(model, "_compiled_call") and torch.equal(got, want), f"run {run}"
    finally:
        torch._dynamo.reset()
        patch.revert()


def reads_of(model):
    """The model's read round (one :class:`StepReads`, shared by its n-gram layers)."""
    held = {id(m._step_reads) for m in ngram_modules(model)}
    assert len(held) == 1
    return ngram_modules(model)[0]._step_reads


def test_a_forward_reads_every_layers_rows_in_one_round_with_the_bits_and_counts_of_layer_by_layer(
        checkpoint, want, tmp_path):
    """The loaded model: the first PLE layer's forward hashes all three layers' ids and reads their misses together;
    every layer takes its ids from the round and reads nothing in its call. transformers' bits; each layer's cache
    counts the hits, misses and evictions of the same model reading layer by layer (a copy: no round), with the same
    bits."""
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path))
    reads = reads_of(model)
    assert_same_steps(run_steps(model, prompts((2, 5), seed=7), STEPS), want)
    forwards = STEPS + 1
    assert reads.stats == {"rounds": forwards, "failed": 0, "taken": 3 * forwards}
    stats = [m.ngram_embedding.lookups[0].stats() for m in ngram_modules(model)]
    for s in stats:
        assert s["read_ahead"] == forwards and s["lookups"] == forwards
        assert s["rows_ahead"] == s["cache"]["misses"] and s["cache"]["evictions"] > 0  # every miss read ahead
    alone = copy.deepcopy(model)
    assert all(m._step_reads is None for m in ngram_modules(alone))
    assert_same_steps(run_steps(alone, prompts((2, 5), seed=7), STEPS), want)
    for m, s in zip(ngram_modules(alone), stats, strict=True):
        mine = m.ngram_embedding.lookups[0].stats()
        assert mine["read_ahead"] == 0 and mine["cache"] == s["cache"]
    close(alone)
    close(model)
    assert reads._round is None and reads._closed  # closed with the layers


def test_a_failed_round_or_ids_not_the_rounds_leave_each_layer_to_read_its_own(ref, want, checkpoint, tmp_path,
                                                                              monkeypatch):
    """A round that fails (a full cache in one table) is dropped: every layer hashes and reads its own rows, with
    transformers' bits. Ids changed in place after the round, and a layer called on its own, are not the round's."""
    from uvaple.integration.placements.read_round import ReadRound
    from uvaple.uva import RowCacheFull

    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path))
    reads = reads_of(model)
    real, failed = ReadRound.prefetch, []

    def prefetch(self, ids):
        if not failed:
            failed.append(1)
            raise RowCacheFull("no room")
        return real(self, ids)

    monkeypatch.setattr(ReadRound, "prefetch", prefetch)
    assert_same_steps(run_steps(model, prompts((2, 5), seed=7), STEPS), want)
    assert reads.stats == {"rounds": STEPS + 1, "failed": 1, "taken": 3 * STEPS}
    monkeypatch.undo()
    # a real failure of one table's read-ahead (the others read theirs ahead), then a failure outside any
    # read-ahead (the hash): each forward dropped its round and read layer by layer, with transformers' bits
    from uvaple.integration.models import step_reads

    second_lookup = ngram_modules(model)[1].ngram_embedding.lookups[0]
    real_prefetch = type(second_lookup).prefetch
    monkeypatch.setattr(type(second_lookup), "prefetch", lambda self, ids: (_ for _ in ()).throw(
        RowCacheFull("no room")) if self is second_lookup else real_prefetch(self, ids))
    assert_same_steps(run_steps(model, prompts((2, 5), seed=7), 0), want[:1])
    monkeypatch.undo()
    monkeypatch.setattr(step_reads, "ngram_rows", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("hash")))
    assert_same_steps(run_steps(model, prompts((2, 5), seed=7), 0), want[:1])
    monkeypatch.undo()
    assert reads.stats == {"rounds": STEPS + 3, "failed": 3, "taken": 3 * STEPS}
    first, second = ngram_modules(model)[:2]
    ids = prompts((1, 3), seed=3)
    reads.read_ahead(first, ids, None)
    assert reads.take(second, ids, torch.zeros(1, 2, dtype=torch.long)) is None  # another stored context
    reads.read_ahead(first, ids, None)
    assert reads.take(second, ids.clone(), None) is None  # another tensor of the same ids
    reads.read_ahead(first, ids, None)
    ids.add_(0)  # changed in place (its version)
    assert reads.take(second, ids, None) is None
    reads.read_ahead(first, ids, None)
    assert reads.take(second, ids, None) is not None and reads.take(second, ids, None) is None  # taken once
    close(model)


def test_a_round_under_inference_mode_gives_transformers_bits(checkpoint, want, tmp_path):
    """Under ``torch.inference_mode`` the ids and the stored contexts keep no version counter: the round takes
    them by their memory and shape, and every forward after the first is still one round."""
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, **disk(tmp_path))
    with torch.inference_mode():
        got = run_steps(model, prompts((2, 5), seed=7), STEPS)
    assert_same_steps(got, want)
    assert reads_of(model).stats == {"rounds": STEPS + 1, "failed": 0, "taken": 3 * (STEPS + 1)}
    close(model)
