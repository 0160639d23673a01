"""Qwen4Exp's n-gram tables from a checkpoint's shards into host tables: checked first, filled in place.

Layout (:func:`ngram_layout`). PLE layer ``i`` (the ``i``-th of ``config.ple_layer_ids``) has
``(ngram_size - 1) * heads_per_ngram`` heads; head ``h``'s range holds the ``(i * heads + h)``-th prime at or
above ``ngram_vocab_size_base`` rows, the ranges follow each other, and the table is their total rounded up
to ``make_ngram_vocab_size_divisible_by`` rows of ``ple_embed_dim / heads`` values. The primes are found here
(consecutive from the base, each by trial division: microseconds for the real config's ~200 heads).

Checkpoint (:func:`find_shards`). transformers saves a table as ``...layers.{l}.ple.ple_embedding.
ngram_embedding.shard_{k}.weight``, ``k = 0 ..``, the rows of ``torch.chunk(table, split_ngram_parts)``
(fewer shards where the rows do not split evenly), and loads them concatenated. Here every shard of every
layer is located (the safetensors headers only) and checked before any memory is taken: a gap in the
``k`` (or rows missing at the end) is a :class:`ShardMissingError`, a shard of the wrong width or dtype or
rows past the table a :class:`ShardShapeError`, a config without ``ple_layer_ids`` a
:class:`NoPleLayersError`; then the sum of the tables against free host memory
(:class:`~uvaple.uva.HostMemoryError`).

Filling (:func:`load_ngram_tables`), one table per layer, exactly its size:

* as stored (bf16, ...): :meth:`HostTable.from_safetensors` with the shards' names, each read with
  ``pread`` at its row offset by one pool of threads; never a concatenated copy.
* fp8 as stored (transformers' ``FP8Embedding`` layout: fp8 shards and one ``weight_scale``): the codes into
  an fp8 table, served as ``fp8_global`` (:class:`~uvaple.integration.encoded_embedding.HostEncodedEmbedding`).
* ``backend_options={"quantize": "fp8_row", "keep_source": False}``: the shards (memory-mapped) quantised
  straight into an ``fp8_row`` table by :func:`~uvaple.integration.quantize.quantize_fp8_rows_into`, with its
  error report; no table of the source dtype is made. (With the default ``keep_source=True`` the source
  table is loaded and the module quantises it, as for Gemma 3n.)

A table whose fill fails is released by its constructor; the tables filled before it by
:meth:`NGramTables.close`. :meth:`NGramTables.attach` hands each table to its layer's module.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from uvaple.dtypes import fmt_bytes
from uvaple.kernels.encodings import FP8_FORMATS, ROW_SCALE_BYTES
from uvaple.uva import HostMemoryError, HostTable, RowSource, TableFileError
from uvaple.uva.errors import CheckpointError
from uvaple.uva.loading import TensorInfo, checkpoint_files, locate_tensors
from uvaple.uva.memory import row_stride_bytes
from uvaple.uva.system import PAGE_SIZE, mem_available_bytes, round_up
from uvaple.uva.table_file import FileLayout, fitting_source, remove_dead_partials

from ..embedding import QUANTIZE
from ..encoded_embedding import HostEncodedEmbedding
from ..factory import PLACEMENTS
from ..file_embedding import FileEmbedding, check_options, make_folder, reusable, table_file_for

__all__ = ["NGramLayout", "NGramTables", "NoPleLayersError", "ShardMissingError", "ShardShapeError",
           "ngram_layout", "find_shards", "load_ngram_tables"]

# one PLE table's checkpoint tensors: (prefix, decoder layer, shard index or None, "weight" / "weight_scale")
_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.ple\.ple_embedding\.ngram_embedding\."
                  r"(?:shard_(?P<shard>\d+)\.)?(?P<what>weight|weight_scale)$")


class NoPleLayersError(CheckpointError):
    """The config names no PLE layer (``ple_layer_ids`` empty or missing): there is no n-gram table."""


class ShardMissingError(CheckpointError):
    """A PLE table's checkpoint lacks a shard (a gap in ``shard_{k}``, rows missing at the end) or the table."""


class ShardShapeError(CheckpointError):
    """A PLE table's shard has the wrong width or dtype, or the shards hold more rows than the table."""


@dataclass(frozen=True)
class NGramLayout:
    """One PLE layer's table: decoder layer ``layer_idx``, PLE index, ``rows x cols``, head ranges."""

    layer_idx: int
    ple_index: int
    rows: int
    cols: int
    head_sizes: tuple[int, ...]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _primes_from(start: int, count: int) -> list[int]:
    out, n = [], start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


def ngram_layout(config) -> list[NGramLayout]:
    """Every PLE layer's table of a Qwen4Exp (text) config (see the module docstring)."""
    ids = list(getattr(config, "ple_layer_ids", None) or [])
    if not ids:
        raise NoPleLayersError("the config has no ple_layer_ids: this Qwen4Exp has no n-gram table (nothing to put in "
                               "host memory; load it with transformers alone)")
    heads = (config.ngram_size - 1) * config.heads_per_ngram
    dim = config.ple_embed_dim or config.hidden_size
    if heads <= 0 or dim % heads:
        raise CheckpointError(f"ple_embed_dim {dim} is not a multiple of the {heads} n-gram heads")
    primes = _primes_from(config.ngram_vocab_size_base, len(ids) * heads)
    div = config.make_ngram_vocab_size_divisible_by
    out = []
    for i, layer_id in enumerate(sorted(set(ids))):
        sizes = tuple(primes[i * heads:(i + 1) * heads])
        out.append(NGramLayout(layer_id - 1, i, -(-sum(sizes) // div) * div, dim // heads, sizes))
    return out


def _text_config(path: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass
class LayerSource:
    """Where one layer's table is in the checkpoint: its parts (stacked on rows) and, for fp8, its scale."""

    layout: NGramLayout
    parts: list[TensorInfo]
    scale: TensorInfo | None

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype


def find_shards(path: str, layout: list[NGramLayout], files: dict | None = None) -> list[LayerSource]:
    """Locate and check every layer's shards (headers only; see the module docstring for the errors)."""
    files = checkpoint_files(path) if files is None else files
    found: dict[int, dict] = {}
    for key in files:
        m = _KEY.match(key)
        if m is None or m["prefix"].startswith("mtp"):  # transformers skips the multi-token-prediction layers too
            continue
        entry = found.setdefault(int(m["layer"]), {"prefixes": set(), "shards": {}, "whole": None, "scale": None})
        entry["prefixes"].add(m["prefix"])
        if m["what"] == "weight_scale":
            entry["scale"] = key
        elif m["shard"] is None:
            entry["whole"] = key
        else:
            entry["shards"][int(m["shard"])] = key
    out = []
    for lay in layout:
        where = f"PLE layer {lay.ple_index} (decoder layer {lay.layer_idx})"
        entry = found.get(lay.layer_idx)
        if entry is None or not (entry["shards"] or entry["whole"]):
            raise ShardMissingError(f"the checkpoint in {path} has no n-gram table for {where}: expected "
                                    f"'...layers.{lay.layer_idx}.ple.ple_embedding.ngram_embedding.shard_*.weight'")
        if len(entry["prefixes"]) > 1 or (entry["shards"] and entry["whole"]):
            raise CheckpointError(f"the checkpoint in {path} holds {where}'s table twice: {sorted(entry['prefixes'])}")
        if entry["whole"] is not None:
            names = [entry["whole"]]
        else:
            count = max(entry["shards"]) + 1
            gaps = [k for k in range(count) if k not in entry["shards"]]
            if gaps:
                raise ShardMissingError(f"{where}'s table lacks shard(s) {gaps} of shard_0..shard_{count - 1} in "
                                        f"{path}")
            names = [entry["shards"][k] for k in range(count)]
        parts = locate_tensors(path, names, files)
        _check_parts(parts, lay, where, path)
        scale = None
        if parts[0].dtype in FP8_FORMATS:
            if entry["scale"] is None:
                raise CheckpointError(f"{where}'s table is stored as {parts[0].dtype} but the checkpoint has no "
                                      "'...ngram_embedding.weight_scale' for it")
            (scale,) = locate_tensors(path, [entry["scale"]], files)
            if scale.shape not in ((), (1,)) or scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ShardShapeError(f"{where}'s weight_scale is {list(scale.shape)} {scale.dtype}; transformers' "
                                      "FP8Embedding stores one float per table")
        out.append(LayerSource(lay, parts, scale))
    return out


def _check_parts(parts: list[TensorInfo], lay: NGramLayout, where: str, path: str) -> None:
    for info in parts:
        if len(info.shape) != 2 or info.shape[1] != lay.cols or info.dtype != parts[0].dtype:
            raise ShardShapeError(f"{info.name} in {info.path} is {list(info.shape)} {info.dtype}; {where}'s "
                                  f"shards are [*, {lay.cols}] {parts[0].dtype}")
    total = sum(info.shape[0] for info in parts)
    if total < lay.rows:
        raise ShardMissingError(f"{where}'s {len(parts)} shard(s) in {path} hold {total} of its {lay.rows} rows: the "
                                "last shard(s) are missing or truncated")
    if total > lay.rows:
        raise ShardShapeError(f"{where}'s {len(parts)} shard(s) in {path} hold {total} rows; the config makes the "
                              f"table {lay.rows} rows")


def _table_bytes(rows: int, cols: int, dtype: torch.dtype) -> int:
    return round_up(rows * row_stride_bytes(cols * dtype.itemsize), PAGE_SIZE)


def _mapped(info: TensorInfo) -> torch.Tensor:
    """The tensor's bytes in the file, memory-mapped (copy-on-write: never written, never copied)."""
    arr = np.memmap(info.path, dtype=np.uint8, mode="c", offset=info.begin, shape=(info.end - info.begin,))
    return torch.from_numpy(arr).view(info.dtype).view(info.shape)


def _read_scale(info: TensorInfo) -> torch.Tensor:
    with open(info.path, "rb") as f:
        f.seek(info.begin)
        raw = bytearray(f.read(info.end - info.begin))
    return torch.frombuffer(raw, dtype=info.dtype).to(torch.float32).reshape(1)


class NGramTables:
    """The filled tables of one checkpoint, by decoder layer, until :meth:`attach` hands them to the modules."""

    def __init__(self, opts: dict):
        self.opts = opts
        self.tables: dict[int, tuple] = {}  # layer -> (kind, HostTable, extra: scale tensor or QuantError)

    def attach(self, model) -> None:
        """Give each PLE module of ``model`` its layer's table (every layer must have one, and each table a
        module); builds the lookups on the modules' device."""
        mods = [m for m in model.modules() if getattr(m, "uvaple_ngram_table", False)]
        layers = {m.layer_idx for m in mods}
        if layers != set(self.tables):
            raise CheckpointError(f"the model's PLE layers {sorted(layers)} are not the checkpoint's "
                                  f"{sorted(self.tables)}")
        for mod in mods:
            kind, table, extra = self.tables.pop(mod.layer_idx)
            old = mod.ngram_embedding
            if kind == "file":  # a table file: its own module (an fp8_global file also takes its scale)
                opts = dict(backend=old.backend_kind, oob=old.oob, backend_options=dict(old.backend_options),
                            register=old.register_mode, max_tokens=old.max_tokens)
                try:
                    mod.ngram_embedding = FileEmbedding(old.num_embeddings, old.embedding_dim, table,
                                                        out_dtype=old.compute_dtype, weight_scale=extra,
                                                        table_path=table.path, **opts)
                except BaseException:
                    table.close()
                    raise
                old.close()
            elif kind == "raw":
                want = old.compute_dtype  # the model's dtype; the table keeps the checkpoint's
                old.attach_table(table, own=True)
                old.compute_dtype = want
            else:
                opts = dict(backend=old.backend_kind, oob=old.oob, backend_options=dict(old.backend_options),
                            register=old.register_mode, max_tokens=old.max_tokens)
                opts["backend_options"].pop("quantize", None)
                mod.ngram_embedding = HostEncodedEmbedding(
                    old.num_embeddings, old.embedding_dim, table, encoding=kind, out_dtype=old.compute_dtype,
                    weight_scale=extra if kind == "fp8_global" else None,
                    quant_error=extra if kind == "fp8_row" else None, **opts)
                old.close()
            device = mod.layer_multipliers.device
            if device.type == "cuda":
                mod.ngram_embedding._lookup_for(device)  # built now, not inside a compiled or captured forward

    def close(self) -> None:
        """Release the tables not handed to a module."""
        tables, self.tables = self.tables, {}
        for _, table, _ in tables.values():
            table.close()


def load_ngram_tables(path, opts: dict, from_pretrained_kw: dict | None = None) -> NGramTables:
    """Check ``path``'s n-gram tables and fill them (see the module docstring); the loader of the
    ``qwen4_exp`` spec in :data:`uvaple.integration.models.hf.SPECS`."""
    path = os.fspath(path)
    layout = ngram_layout(_text_config(path))
    sources = find_shards(path, layout)
    options = dict(opts.get("backend_options") or {})
    quantize = options.get("quantize")
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"backend_options['quantize'] must be one of {sorted(QUANTIZE)} or None, got {quantize!r}")
    if quantize is not None and sources[0].dtype in FP8_FORMATS:
        raise ValueError(f"this checkpoint's n-gram tables are stored as {sources[0].dtype} already: they are served "
                         "as stored; drop backend_options['quantize']")
    folder = check_file_options(opts.get("backend", "uva"), options, opts.get("max_tokens"))
    if folder is not None:
        return _file_tables(sources, opts, folder, quantize)
    from_shards = quantize is not None and not options.get("keep_source", True)
    need = 0
    for src in sources:
        lay = src.layout
        if not from_shards:  # the table as stored
            need += _table_bytes(lay.rows, lay.cols, src.dtype)
        if quantize is not None:  # its fp8_row table (from the shards, or built beside the source)
            need += _table_bytes(lay.rows, lay.cols + ROW_SCALE_BYTES, QUANTIZE[quantize])
    avail = mem_available_bytes()
    if avail is not None and need > avail:
        raise HostMemoryError(f"the {len(sources)} n-gram tables of {path} need {fmt_bytes(need)} of host memory; "
                              f"{fmt_bytes(avail)} is available (MemAvailable). Free memory, or quantise them "
                              "(backend_options={'quantize': 'fp8_row', 'keep_source': False} needs about half)")
    tables = NGramTables(opts)
    register = opts.get("register", "auto")
    try:
        for src in sources:
            if from_shards:
                table, err = _quantized_from_shards(src, QUANTIZE[quantize], register)
                tables.tables[src.layout.layer_idx] = ("fp8_row", table, err)
            else:
                table = HostTable.from_safetensors(path, [p.name for p in src.parts], register=register)
                tables.tables[src.layout.layer_idx] = (("raw", table, None) if src.scale is None else
                                                       ("fp8_global", table, _read_scale(src.scale)))
    except BaseException:
        tables.close()
        raise
    return tables


def _quantized_from_shards(src: LayerSource, fmt: torch.dtype, register):
    from ..quantize import quantize_fp8_rows_into

    lay = src.layout
    table = HostTable.empty(lay.rows, lay.cols + ROW_SCALE_BYTES, fmt, register=register)
    try:
        err = quantize_fp8_rows_into([_mapped(p) for p in src.parts], table.bytes_view(), fmt)
    except BaseException:
        table.close()
        raise
    return table, err


# ---------------------------------------------------------------------- table files (a placement that reads them)
def check_file_options(backend: str, backend_options: dict | None, max_tokens) -> str | None:
    """For a placement that reads table files (``disk``): the folder of the table files (``backend_options
    ["table_dir"]``), and ``max_tokens`` given; named errors otherwise. None for the other placements."""
    entry = PLACEMENTS.get(backend) if isinstance(backend, str) else None
    folder = (backend_options or {}).get("table_dir")
    if entry is None or not entry.reads_file:
        if folder is not None and entry is not None:
            readers = [name for name, p in PLACEMENTS.items() if p.reads_file]
            raise ValueError(f"backend_options['table_dir'] is the folder of table files, which backend={backend!r} "
                             f"does not read: drop it, or serve the tables with {readers}")
        return None
    if not isinstance(folder, (str, os.PathLike)) or not os.fspath(folder):
        raise ValueError(f"backend={backend!r} serves each n-gram table from a table file: give their folder as "
                         "backend_options['table_dir'] (written there once, reused while the checkpoint is the same)")
    folder = os.path.expanduser(os.fspath(folder))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"backend_options['table_dir'] {os.fspath(folder)!r} is a file, not a folder: give the folder "
                         "the table files go in")
    if max_tokens is None:
        raise ValueError(f"backend={backend!r} stages each forward's ids in pinned memory sized once: pass max_tokens "
                         "(the most tokens a forward brings: batch x prompt length for a prefill)")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    check_options(backend, backend_options)  # before any file is written
    return folder


def table_file_path(folder: str, layer_idx: int, form: str) -> str:
    """The table file of decoder layer ``layer_idx``'s n-gram table in ``folder``, its rows in ``form``: ``raw``,
    ``fp8_global`` (an fp8 checkpoint's codes) or a ``quantize`` value (``fp8_row``, ``fp8_row_e5m2``)."""
    return os.path.join(folder, f"qwen4_exp_ngram_layer{layer_idx:03d}_{form}.uvtable")


def _source_id(src: LayerSource, encoding: str, fmt: torch.dtype | None) -> str:
    """What a layer's table file is written from: each part's tensor, where it lies in which file (the file's path,
    device, inode, size and its modification and change times: a checkpoint written again, copied or replaced is
    another source, and ``utime`` cannot set a change time), the encoding and its fp8 format; a digest."""
    parts = []
    for info in [*src.parts, *([src.scale] if src.scale is not None else [])]:
        st = os.stat(info.path)
        parts.append([os.path.realpath(info.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                      info.name, info.begin, info.end])
    text = json.dumps({"tensors": parts, "encoding": encoding, "format": str(fmt)}, sort_keys=True)
    digest = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    first = src.parts[0]
    more = f" and {len(src.parts) - 1} more shard(s)" if len(src.parts) > 1 else ""
    form = encoding if fmt is None else f"{encoding} {str(fmt).replace('torch.', '')}"
    # a long or non-ASCII path: the tensor and the digest name it; a long tensor name: the digest
    return fitting_source(f"{first.name}{more} of {os.path.realpath(first.path)} as {form}; {digest}",
                          f"{first.name}{more} as {form}; {digest}", f"{form}; {digest}")


def _file_tables(sources: list[LayerSource], opts: dict, folder: str, quantize: str | None) -> NGramTables:
    """Each layer's table file in ``folder``: the one there when it was written from the same shards in the same
    encoding, else written now from the shards (quantised on the way for ``quantize``). The free space of the
    folder's disk is checked against the files to write (each beside the file it replaces, one at a time) before
    the first is written."""
    from ..quantize import fp8_row_source

    plans = []  # (layer source, path, rows, encoding, source id, the file there if it is reused, open)
    max_tokens = opts["max_tokens"]
    for src in sources:
        rows = RowSource.stacked(src.parts)
        fmt = None
        if src.scale is not None:
            encoding = "fp8_global"  # fp8 codes as stored, with the table's scale
        elif quantize is not None:
            fmt = QUANTIZE[quantize]
            encoding, rows = "fp8_row", fp8_row_source(rows, fmt)
        else:
            encoding = "raw"
        # each layer's cache holds a forward's rows: its tokens' ids of every head
        check_options(opts["backend"], opts.get("backend_options"), max_rows=max_tokens * len(src.layout.head_sizes),
                      row_bytes=rows.cols * rows.dtype.itemsize)
        path = table_file_path(folder, src.layout.layer_idx, quantize or encoding)
        sid = _source_id(src, encoding, fmt)
        plans.append((src, path, rows, encoding, sid, reusable(path, rows, encoding, sid)))
    tables = NGramTables(opts)
    try:
        _check_space(folder, plans)
        for src, path, rows, encoding, sid, kept in plans:
            lay = src.layout
            what = f"PLE layer {lay.ple_index + 1} of {len(plans)} (decoder layer {lay.layer_idx})'s n-gram table"
            file = kept or table_file_for(path, rows, encoding=encoding, source_id=sid, what=what)
            tables.tables[src.layout.layer_idx] = ("file", file, None if src.scale is None else _read_scale(src.scale))
    except BaseException:
        handed = {id(entry[1]) for entry in tables.tables.values()}
        tables.close()
        for *_, kept in plans:  # the files kept open for reuse and not handed over yet
            if kept is not None and id(kept) not in handed:
                kept.close()
        raise
    return tables


def _check_space(folder: str, plans: list) -> None:
    """The files are written one at a time, each beside the one it replaces until it is renamed over it: the most
    the folder's disk must hold at once beyond what it holds now, against its free space (a TableFileError)."""
    peak = extra = 0
    for _, path, r, enc, _, kept in plans:
        remove_dead_partials(path)  # a killed load's leftovers are not in the way
        if kept is None:
            extra += FileLayout.of(r.rows, r.cols, r.dtype, enc).file_bytes
            peak = max(peak, extra)
            extra -= os.path.getsize(path) if os.path.exists(path) else 0
    if peak:
        make_folder(folder)
        free = shutil.disk_usage(folder).free
        if peak > free:
            raise TableFileError(f"the n-gram table files to write in {folder} need {fmt_bytes(peak)} more on its disk "
                                 f"(each new file is written beside the one it replaces); it has {fmt_bytes(free)} "
                                 "free: free space, or give backend_options['table_dir'] on a larger disk")
