"""The small random checkpoints of the engine check, built and saved by transformers 5.17 (runs on a CPU).

``python3 perf/vllm_carry/checkpoints.py [--work /tmp/vllm_engine] [--models gemma3n,qwen4exp_bf16,qwen4exp_fp8]``
writes ``WORK/ckpt/<model>/`` (a ``.done`` file records what was built; a model already built is kept), each
with a word-level tokenizer of ``VOCAB`` words ``w0 .. w65535`` (the specials first), so prompts are
strings (:func:`prompts`) and ``vllm serve`` takes them as text:

* ``gemma3n``: the multimodal ``Gemma3nForConditionalGeneration``: transformers builds and saves the text
  model, its tensors are saved under the multimodal names (``model.language_model.*``) beside a
  ``Gemma3nConfig`` and a ``Gemma3nProcessor`` (the tokenizer carries the image and audio tokens, and the runs of
  newlines that vLLM's processing looks up: ``GEMMA3N_VOCAB_LOOKUPS``). vLLM is given no image or audio per
  prompt and builds no tower.
  bf16; the per-layer table is 65,536 x (4 x 256). ``hot_profile.txt``: the prompts' token ids (a hot set's
  profile).
* ``qwen4exp_bf16``: ``Qwen4ExpForCausalLM``, three linear-attention layers and one attention layer, PLE
  on layers 1 and 2, n-gram tables of 8 heads x ~50,000 rows x 160 saved in ``split_ngram_parts`` = 4
  shards (``ngram_embedding.shard_<i>.weight``, as transformers saves them). transformers builds a QSA
  indexer on every attention layer; it is dropped from the checkpoint and the config, so vLLM builds its
  plain attention. The hidden size is 258 unless ``cutlass`` and ``quack`` import (:func:`qwen_hidden`).
* ``qwen4exp_fp8``: the same tensors, each n-gram table in fp8 e4m3 with one global fp32 scale
  (``ngram_embedding.weight_scale``; ``ple_embedding_dtype: float8_e4m3fn`` in the config).

Weights are random, the embedding tables' of every magnitude (``N(0, 1.5)``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable

MODELS = ("gemma3n", "qwen4exp_bf16", "qwen4exp_fp8")
PROMPTS, PROMPT_SEED = 8, 1234

# the small models: sizes chosen so a run starts in seconds and the PLE table is large enough to see in
# the GPU memory vLLM reports (Gemma 3n: 65,536 x 4 x 256 bf16 = 128 MiB; Qwen4Exp: two n-gram tables of
# 8 heads x ~50,000 rows of 160 B in fp8, as the real model's rows)
VOCAB = 65536
GEMMA = dict(layers=4, hidden=256, ple_vocab=65536, ple_dim=256)
QWEN = dict(layers=4, hidden=256, hc_count=2, ple_layers=[1, 2], ngram_size=3, heads_per_ngram=4,
            ngram_base=50000, ple_embed_dim=1280, split_parts=4, experts=8, topk=2)
FP8_MAX = 448.0



def _words(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def save_tokenizer(path: str, vocab: int, specials: list[str], extra: dict[str, str] | None = None):
    """A word-level tokenizer of ``vocab`` entries: the specials first, then ``w<i>`` words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = specials + [w for w in _words(vocab) if w not in specials][: vocab - len(specials)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    kw = dict(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    if extra:
        kw["extra_special_tokens"] = extra
    fast = PreTrainedTokenizerFast(**kw)
    fast.save_pretrained(path)
    return fast


def prompts(n: int = PROMPTS, seed: int = PROMPT_SEED, lo: int = 16, vocab: int = VOCAB) -> list[str]:
    """``n`` prompts of 6 to 40 random words (deterministic)."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(lo, vocab)}" for _ in range(rng.randrange(6, 41))) for _ in range(n)]


def _randomise(model, seed: int) -> None:
    """Weights of every magnitude (an initialiser's small values would hide a wrong row)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and ("embed" in name or "ngram" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 1.5)


#: the media tokens of Gemma 3n's processor, by the names its tokenizer gives them
GEMMA3N_MEDIA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                        "image_token": "<image_soft_token>", "boa_token": "<start_of_audio>",
                        "eoa_token": "<end_of_audio>", "audio_token": "<audio_soft_token>"}
#: what vLLM 0.33's Gemma 3n processing reads from ``tokenizer.get_vocab()`` by key for every prompt, images or
#: none (``gemma3n_mm.py``: ``_apply_token_matches`` merges newline runs as Gemma's tokenizer does,
#: ``_find_mm_placeholders`` splits them again). A key missing from the vocabulary stops ``LLM()`` with a KeyError
#: before the model is built: "\n" did first, then "\n\n\n".
GEMMA3N_VOCAB_LOOKUPS = ("\n", "\n\n", "\n\n\n", "\n\n\n\n")


#: Gemma 3n's tokenizer's first ids (pad 0, eos 1, bos 2, unk 3), then the media tokens and the newline runs
GEMMA3N_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", *GEMMA3N_MEDIA_TOKENS.values(), *GEMMA3N_VOCAB_LOOKUPS)


def save_gemma3n_tokenizer(path: str, vocab: int = VOCAB):
    """Gemma 3n's word-level tokenizer of ``vocab`` entries: the specials (:data:`GEMMA3N_SPECIALS`) first."""
    return save_tokenizer(path, vocab, list(GEMMA3N_SPECIALS), GEMMA3N_MEDIA_TOKENS)


def save_gemma3n_frame(path: str, text) -> tuple:
    """Everything of a multimodal Gemma 3n checkpoint but its weights, around the text model ``text`` (a
    ``Gemma3nTextConfig``): a tokenizer of its vocabulary, the ``Gemma3nForConditionalGeneration`` config naming
    the tokenizer's media tokens, and the processor vLLM's Gemma 3n processing loads. Returns (the tokenizer,
    the media tokens' ids by name)."""
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nConfig, Gemma3nProcessor, SiglipImageProcessor

    tok = save_gemma3n_tokenizer(path, text.vocab_size)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3N_MEDIA_TOKENS.items()}
    text.pad_token_id, text.eos_token_id, text.bos_token_id = 0, 1, 2
    full = Gemma3nConfig(text_config=text.to_dict(), boi_token_id=ids["boi_token"], eoi_token_id=ids["eoi_token"],
                         image_token_id=ids["image_token"], boa_token_id=ids["boa_token"],
                         eoa_token_id=ids["eoa_token"], audio_token_id=ids["audio_token"])
    full.architectures = ["Gemma3nForConditionalGeneration"]
    full.dtype = "bfloat16"
    full.save_pretrained(path)
    Gemma3nProcessor(feature_extractor=Gemma3nAudioFeatureExtractor(), image_processor=SiglipImageProcessor(),
                     tokenizer=tok).save_pretrained(path)
    return tok, ids


def build_gemma3n(path: str, log: Callable[[str], object]) -> dict:
    """The multimodal Gemma 3n class: transformers' text model and save, under the multimodal names."""
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    g = GEMMA
    layer_types = ["sliding_attention", "full_attention"] * (g["layers"] // 2)
    text = Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=g["ple_vocab"], hidden_size=g["hidden"],
        hidden_size_per_layer_input=g["ple_dim"], intermediate_size=[4 * g["hidden"]] * g["layers"],
        num_hidden_layers=g["layers"], num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_kv_shared_layers=2, laurel_rank=16, altup_num_inputs=4,
        activation_sparsity_pattern=[0.95] + [0.0] * (g["layers"] - 1), sliding_window=128,
        max_position_embeddings=4096, layer_types=layer_types, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    text.architectures = ["Gemma3nForCausalLM"]
    torch.manual_seed(0)
    hf = Gemma3nForCausalLM(text).to(torch.bfloat16)
    _randomise(hf, 1)
    tok, _ = save_gemma3n_frame(path, text)
    sd = {k.replace("model.", "model.language_model.", 1): v.contiguous() for k, v in hf.state_dict().items()
          if k.startswith("model.")}
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    # the hot set's profile (engine_check's uva_hot): the prompts' token ids, as a tokenised text like the served one
    ids = [i for p in prompts() for i in tok(p, add_special_tokens=False)["input_ids"]]
    with open(os.path.join(path, "hot_profile.txt"), "w") as f:
        f.write(" ".join(map(str, ids)))
    table = hf.model.embed_tokens_per_layer.weight
    return {"arch": "Gemma3nForConditionalGeneration", "ple_tables": 1,
            "ple_table_bytes": table.numel() * table.element_size(), "ple_shape": list(table.shape),
            "params": sum(p.numel() for p in hf.parameters()), "hidden_size": g["hidden"]}


def qwen_hidden(log: Callable[[str], object]) -> tuple[int, str]:
    """Qwen4Exp's hidden size: 256, or 258 where cutlass/quack are missing (see the module docstring)."""
    import importlib.util

    have = [m for m in ("cutlass", "quack") if importlib.util.find_spec(m) is not None]
    if len(have) == 2:
        return QWEN["hidden"], "cutlass and quack importable: hc_count * hidden_size = 512, the CuTe-DSL path"
    return 258, (f"{'/'.join(sorted({'cutlass', 'quack'} - set(have)))} not importable: hidden_size 258 (hc_count * "
                 "hidden_size = 516, not a multiple of 8), so vLLM's Qwen4Exp takes its Linear hyper-connection "
                 "path instead of the CuTe-DSL kernel (nvidia-cutlass-dsl, quack-kernels) on SM90")


def build_qwen4exp(path: str, log: Callable[[str], object], hidden: int) -> dict:
    """``Qwen4ExpForCausalLM``: PLE on two linear-attention layers, n-gram tables in ``split_parts`` shards."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    q = QWEN
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    save_tokenizer(path, VOCAB, specials)
    layer_types = ["linear_attention"] * (q["layers"] - 1) + ["qwen_sparse_attention"]
    cfg = Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=q["layers"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, num_experts=q["experts"], num_experts_per_tok=q["topk"],
        hc_count=q["hc_count"], hc_lowrank=32, ple_layer_ids=q["ple_layers"], ple_embed_dim=q["ple_embed_dim"],
        ngram_size=q["ngram_size"], heads_per_ngram=q["heads_per_ngram"], ngram_vocab_size_base=q["ngram_base"],
        split_ngram_parts=q["split_parts"], max_position_embeddings=4096, layer_types=layer_types,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        output_gate_type="silu",  # vLLM's GDN asserts it is named (transformers' None means hidden_act)
        **QSA)
    cfg.architectures = ["Qwen4ExpForCausalLM"]
    torch.manual_seed(0)
    hf = Qwen4ExpForCausalLM(cfg).to(torch.bfloat16)
    _randomise(hf, 2)
    hf.config.dtype = "bfloat16"
    hf.save_pretrained(path)
    dropped = drop_indexer(path)
    tables = [(n, p) for n, p in hf.named_parameters() if n.endswith("ngram_embedding.weight")]
    return {"arch": "Qwen4ExpForCausalLM", "ple_tables": len(tables), "ple_shape": list(tables[0][1].shape),
            "ple_table_bytes": sum(p.numel() * p.element_size() for _, p in tables),
            "params": sum(p.numel() for p in hf.parameters()), "hidden_size": hidden,
            "shards": sorted(k for k in _safetensors_keys(path) if ".shard_" in k)[:4],
            "attention": f"vLLM's Qwen3NextAttention: the QSA indexer ({len(dropped)} tensors) is dropped from the "
                         "checkpoint and its config (transformers builds one on every attention layer; vLLM builds "
                         "none without indexer_n_heads)"}


#: transformers 5.17 builds a QSA indexer on every attention layer and needs these to do so
QSA = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=64, indexer_compress_ratio=4)


def drop_indexer(path: str) -> list[str]:
    """The checkpoint without the QSA indexer: its config fields unset, its tensors removed (one file)."""
    import torch  # noqa: F401 - safetensors.torch needs it
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    for k in QSA:
        cfg[k] = None
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    tensors, dropped = {}, []
    for f in files:
        with safe_open(os.path.join(path, f), "pt") as st:
            for k in st.keys():
                if ".indexer." in k:
                    dropped.append(k)
                else:
                    tensors[k] = st.get_tensor(k)
    for f in files + [f for f in os.listdir(path) if f.endswith(".safetensors.index.json")]:
        os.remove(os.path.join(path, f))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return dropped


def _safetensors_keys(path: str) -> list[str]:
    from safetensors import safe_open

    keys = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                keys += list(st.keys())
    return keys


def to_fp8(src: str, dst: str) -> dict:
    """``src``'s checkpoint with each n-gram table in fp8 e4m3 and one global fp32 scale (vLLM's format)."""
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and not f.endswith(".safetensors.index.json"):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["ple_embedding_dtype"] = "float8_e4m3fn"
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(src, f), "pt") as st:
                tensors.update({k: st.get_tensor(k) for k in st.keys()})
    tables: dict[str, list[str]] = {}
    for k in tensors:
        m = re.match(r"(.*ngram_embedding)\.(shard_\d+\.)?weight$", k)
        if m:
            tables.setdefault(m.group(1), []).append(k)
    scales, fp8_bytes = {}, 0
    for prefix, keys in tables.items():
        amax = max(float(tensors[k].float().abs().max()) for k in keys)
        scale = amax / FP8_MAX
        for k in keys:
            tensors[k] = (tensors[k].float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
            fp8_bytes += tensors[k].numel()
        tensors[f"{prefix}.weight_scale"] = torch.tensor(scale, dtype=torch.float32)
        scales[prefix] = scale
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return {"ple_dtype": "float8_e4m3fn", "scales": scales, "ple_table_bytes": fp8_bytes}


def digest(path: str) -> str:
    """SHA-256 over a checkpoint's files (names and bytes, in name order; the ``.done`` record left out): engine
    runs of another call are compared with this call's only when they served the same bytes."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(path) if f != ".done" and os.path.isfile(os.path.join(path, f))):
        h.update(name.encode() + b"\0")
        with open(os.path.join(path, name), "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def checkpoints(work: str, models: list[str], log: Callable[[str], object]) -> dict:
    """Build the checkpoints that are missing (a ``.done`` file says one is whole)."""
    out = {}
    root = os.path.join(work, "ckpt")
    hidden, why = qwen_hidden(log)
    for name in models:
        path = os.path.join(root, name)
        done = os.path.join(path, ".done")
        if os.path.exists(done):
            out[name] = json.load(open(done))
            continue
        t0 = time.monotonic()
        os.makedirs(path, exist_ok=True)
        if name == "gemma3n":
            info = build_gemma3n(path, log)
        elif name == "qwen4exp_bf16":
            info = build_qwen4exp(path, log, hidden)
            info["hidden_size_why"] = why
        elif name == "qwen4exp_fp8":
            bf16 = os.path.join(root, "qwen4exp_bf16")
            if not os.path.exists(os.path.join(bf16, ".done")):
                checkpoints(work, ["qwen4exp_bf16"], log)
            info = dict(json.load(open(os.path.join(bf16, ".done"))), **to_fp8(bf16, path))
        else:
            raise ValueError(name)
        info.update(path=path, seconds=round(time.monotonic() - t0, 1),
                    bytes=sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)), digest=digest(path))
        json.dump(info, open(done, "w"), indent=1)
        log(f"checkpoint {name}: {info['arch']}, {info['params'] / 1e6:.1f} M parameters, PLE "
            f"{info['ple_table_bytes'] / (1 << 20):.0f} MiB in {info['ple_tables']} table(s), {info['seconds']} s")
        out[name] = info
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/vllm_engine", help="WORK/ckpt/<model> is written")
    p.add_argument("--models", default=",".join(MODELS))
    a = p.parse_args(argv)
    models = [m for m in a.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"--models: {bad} not in {list(MODELS)}")
    info = checkpoints(os.path.abspath(a.work), models, print)
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
