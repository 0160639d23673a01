"""Streaming one tensor of a safetensors checkpoint, or several stacked on rows (a table saved as shards),
into a ``HostTable``.

The safetensors header is parsed here (8-byte little-endian length, then JSON), every field checked
against the file, and the rows read with ``os.preadv`` straight into the table's memory by several
threads in blocks (``pread`` drops the GIL; the blocks of every shard share one pool of threads). When the
table's row stride equals the file's row size and dtypes agree, bytes go from the page cache into the
table with no intermediate buffer; otherwise each thread reuses one bounded staging block (at most
``_BLOCK_BYTES``) to re-stride or cast. Nothing is ever staged through the GPU, and peak extra memory is
``threads x _BLOCK_BYTES`` whatever the table size. Each thread commits the pages of its block before
reading into it (``HostTable._commit_rows``: a shortage is a named error, never a SIGBUS), so a table
filled here is not pre-faulted first.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from uvaple.dtypes import SAFETENSORS_DTYPES, TABLE_DTYPES

from . import system
from .errors import CheckpointError
from .workers import default_threads, parallel

_DTYPES = SAFETENSORS_DTYPES

# Largest header we accept: real checkpoints have headers of a few hundred KiB.
_MAX_HEADER_BYTES = 100 << 20
# Rows per read: 64 MiB blocks keep 16 threads busy and bound the staging memory.
_BLOCK_BYTES = 64 << 20

__all__ = ["TensorInfo", "locate_tensor", "locate_tensors", "read_header", "stream_into", "stream_parts_into",
           "check_parts", "safetensors_fill", "checkpoint_files"]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range of its data."""

    path: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.dtype.itemsize


def _kind_of(head: bytes) -> str:
    """What a file that is not safetensors looks like, from its first bytes."""
    if head[:2] == b"PK":
        return "a zip archive: torch.save's format, such as pytorch_model.bin"
    if head[:1] == b"\x80":
        return "a Python pickle"
    if head[:4] == b"GGUF":
        return "a GGUF file"
    return f"its first bytes are {head!r}"


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """Parse and validate a safetensors header; returns (entries, data start offset)."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(9)
            if len(raw) < 9:
                raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, too short for a header")
            if raw[8:9] != b"{":  # a safetensors header is a JSON object after its 8-byte length
                raise CheckpointError(f"{path} is not a safetensors file ({_kind_of(raw)}): uvaple reads safetensors "
                                      "checkpoints; save it as one (transformers: save_pretrained(dir, "
                                      "safe_serialization=True); torch: safetensors.torch.save_file)")
            (n,) = struct.unpack("<Q", raw[:8])
            f.seek(8)
            if n <= 0 or n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path} has a corrupt or truncated safetensors header (length {n}, file {size} bytes); "
                    f"re-download or re-save the checkpoint")
            body = f.read(n)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {path} does not exist") from e
    except IsADirectoryError as e:
        raise CheckpointError(f"{path} is a directory, expected a .safetensors file") from e
    try:
        header = json.loads(body)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} has a corrupt safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def _entry(path: str, name: str, header: dict, data_start: int) -> TensorInfo:
    size = os.path.getsize(path)
    e = header[name]
    try:
        dtype_name, shape, (lo, hi) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: entry {name!r} is malformed ({err})") from err
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype_name!r}")
    dtype = _DTYPES[dtype_name]
    itemsize = dtype.itemsize
    n = 1
    for s in shape:
        n *= s
    if hi - lo != n * itemsize or lo < 0:
        raise CheckpointError(
            f"{path}: tensor {name!r} claims shape {list(shape)} {dtype_name} ({n * itemsize} bytes) but its "
            f"data range is {lo}..{hi}; the checkpoint is corrupt")
    if data_start + hi > size:
        raise CheckpointError(
            f"{path} is truncated: tensor {name!r} ends at byte {data_start + hi} but the file has {size}; "
            f"re-download or re-save the checkpoint")
    return TensorInfo(path, name, dtype, shape, data_start + lo, data_start + hi)


def _suggest(name: str, names) -> str:
    """Names that end like ``name`` (e.g. a checkpoint with a different module prefix)."""
    tail = ".".join(name.split(".")[-2:])
    close = sorted(k for k in names if k.endswith(tail))
    return (" Tensors with a similar name: " + ", ".join(close[:5])) if close else ""


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a file or a checkpoint directory.

    In a directory, ``model.safetensors.index.json`` maps names to shards; without one every
    ``*.safetensors`` file's header is read.
    """
    p = Path(path)
    if not p.is_dir():
        header, _ = read_header(p)
        return {k: p for k in header}
    index = p / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {k: p / v for k, v in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is corrupt: {e!r}") from e
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {p}")
    found: dict[str, Path] = {}
    for f in files:
        found.update((k, f) for k in read_header(f)[0])
    return found


def locate_tensor(path: str | os.PathLike, name: str) -> TensorInfo:
    """Find tensor ``name`` in a safetensors file or a checkpoint directory (sharded or not).

    The tensor must be 2-D ``[rows, cols]``.
    """
    files = checkpoint_files(path)
    if name not in files:
        where = path if not Path(path).is_dir() else f"the checkpoint in {path}"
        raise CheckpointError(f"tensor {name!r} is not in {where}.{_suggest(name, files)}")
    file = files[name]
    header, data_start = read_header(file)
    if name not in header:
        raise CheckpointError(f"tensor {name!r} is not in {file}.{_suggest(name, header)}")
    info = _entry(str(file), name, header, data_start)
    if len(info.shape) != 2 or info.shape[0] == 0 or info.shape[1] == 0:
        raise CheckpointError(f"tensor {name!r} in {file} has shape {list(info.shape)}; a table is 2-D, with rows "
                              "and columns")
    return info


def locate_tensors(path: str | os.PathLike, names: list[str], files: dict[str, Path] | None = None
                   ) -> list[TensorInfo]:
    """:func:`locate_tensor` for many names, reading each file's header once (``files``: a
    :func:`checkpoint_files` result already in hand). Any dimensionality; a missing name is a named error."""
    files = checkpoint_files(path) if files is None else files
    headers: dict[Path, tuple[dict, int]] = {}
    out = []
    for name in names:
        if name not in files:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint in {path}.{_suggest(name, files)}")
        file = files[name]
        if file not in headers:
            headers[file] = read_header(file)
        header, data_start = headers[file]
        if name not in header:
            raise CheckpointError(f"tensor {name!r} is not in {file}.{_suggest(name, header)}")
        out.append(_entry(str(file), name, header, data_start))
    return out


def _read_exact(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    got = system.pread_full(fd, views, offset)
    if got < sum(v.nbytes for v in views):
        raise CheckpointError(f"{path} ended early at byte {offset + got} (file changed while loading?)")


def stream_into(table, info: TensorInfo, *, threads: int) -> None:
    """Read ``info``'s rows into ``table`` (same shape; cast when the table's dtype differs)."""
    rows, cols = info.shape
    if (rows, cols) != (table.rows, table.cols):
        raise CheckpointError(f"tensor {info.name!r} is {rows}x{cols}, the table is {table.rows}x{table.cols}")
    stream_parts_into(table, [info], threads=threads)


def check_parts(parts: list[TensorInfo], rows: int, cols: int) -> None:
    """``parts`` stacked on rows make a ``[rows, cols]`` table: each is 2-D with ``cols`` columns and one dtype,
    and their rows add up (a named error otherwise)."""
    if not parts:
        raise CheckpointError("no tensors to load")
    for info in parts:
        if len(info.shape) != 2 or info.shape[1] != cols or info.dtype != parts[0].dtype:
            raise CheckpointError(
                f"tensor {info.name!r} in {info.path} is {list(info.shape)} {info.dtype}; every part of this table "
                f"is [*, {cols}] {parts[0].dtype}")
    total = sum(info.shape[0] for info in parts)
    if total != rows:
        raise CheckpointError(f"the {len(parts)} parts ({parts[0].name!r} ...) hold {total} rows; the table has {rows}")


def stream_parts_into(table, parts: list[TensorInfo], *, threads: int) -> None:
    """Read ``parts`` (2-D tensors of ``table.cols`` columns, :func:`check_parts`) into consecutive rows of
    ``table``, casting when the table's dtype differs. Every part's blocks go to one pool of ``threads``
    threads, so many small shards load as fast as one large tensor."""
    check_parts(parts, table.rows, table.cols)
    dtype = parts[0].dtype
    if dtype not in TABLE_DTYPES and dtype != table.dtype:
        raise CheckpointError(f"tensor {parts[0].name!r} has dtype {dtype}, which cannot be cast into a table")
    src_row = parts[0].row_bytes
    direct = dtype == table.dtype and src_row == table.stride_bytes
    block_rows = max(1, _BLOCK_BYTES // max(src_row, table.stride_bytes))
    raw = memoryview(table._raw_buffer()).cast("B")
    dst_bytes = table.bytes_view()
    dst_tensor = table.tensor
    fds: dict[str, int] = {}
    try:
        ranges = []  # (fd, part, first row of the part in the table, first row in the part, rows)
        start = 0
        for info in parts:
            if info.path not in fds:
                fds[info.path] = os.open(info.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fds[info.path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
                except (AttributeError, OSError):
                    pass
            n = info.shape[0]
            ranges += [(fds[info.path], info, start, r, min(block_rows, n - r)) for r in range(0, n, block_rows)]
            start += n

        def load(fd: int, info: TensorInfo, base: int, r: int, n: int) -> None:
            r0 = base + r
            table._commit_rows(r0, n)  # this block's pages: a shortage is a named error, never a SIGBUS
            offset = info.begin + r * src_row
            if direct:
                _read_exact(fd, [raw[r0 * src_row:(r0 + n) * src_row]], offset, info.path)
                return
            staging = bytearray(n * src_row)
            _read_exact(fd, [memoryview(staging)], offset, info.path)
            if dtype == table.dtype:
                import numpy as np

                src = np.frombuffer(staging, dtype=np.uint8).reshape(n, src_row)
                dst_bytes[r0:r0 + n, :src_row] = src
            else:
                src = torch.frombuffer(staging, dtype=dtype).view(n, table.cols)
                dst_tensor[r0:r0 + n].copy_(src)

        parallel(load, ranges, threads, name="uvaple-load")
    finally:
        for fd in fds.values():
            os.close(fd)


def safetensors_fill(info: TensorInfo | list[TensorInfo], *, threads: int | None = None):
    """A ``fill`` for :meth:`HostTable.shared` (or ``HostTable._filled``) that streams ``info``
    (:func:`locate_tensor`) in, or a list of parts stacked on rows (:func:`stream_parts_into`)."""

    def fill(table) -> None:
        if isinstance(info, TensorInfo):
            stream_into(table, info, threads=threads or default_threads())
        else:
            stream_parts_into(table, info, threads=threads or default_threads())

    return fill
