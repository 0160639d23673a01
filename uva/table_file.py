"""A table as a file on local disk, read a page at a time: the storage under a disk placement.

Layout (version 1). Every offset is a multiple of :data:`PAGE` (4 KiB), so direct I/O (``O_DIRECT``) reads
any page into a page-aligned buffer:

* page 0, the header: :data:`MAGIC` (16 bytes), then UTF-8 JSON (``version``, ``rows``, ``cols``, ``dtype``
  as safetensors names it, ``encoding``, ``row_bytes``, ``stride``, ``rows_per_page``, ``pages_per_row``,
  ``data_pages``, ``complete``, and ``source`` where the writer named what the rows were written from),
  zero-padded to the page;
* the data, from page 1. Each row is its ``row_bytes`` (an encoding's scale bytes inside the row, as a
  host table holds it) at the host table's stride (the row rounded up to 16 bytes). Rows no larger than a
  page are packed whole into pages: ``rows_per_page = PAGE // stride``, row ``r`` in data page
  ``r // rows_per_page`` at byte ``(r % rows_per_page) * stride``, so one 4 KiB read brings any row (the I/O
  floor of a miss is one page). A larger row starts on a page and takes ``pages_per_row`` pages. The rows
  of a page lie at the host stride, so a page copies into a host table's rows as it is;
* the sums: one CRC-32 (zlib's) per data page, little-endian uint32, zero-padded to a page.

Written once (:func:`write_table_file`): into ``PATH.partial.<pid>`` (the writer's own: two writers of one path
never share it; one left by a writer that was killed is removed by the next), the data pages and their sums by several
threads (each a range of pages, from a tensor, a :class:`~uvaple.uva.HostTable`, a safetensors tensor read
in blocks, or a :class:`RowSource` that computes its rows block by block, such as a quantiser over one of
those, so a table larger than host memory streams through), then ``fsync``, then the header with
``complete`` true, ``fsync``, and a rename to ``PATH`` (and an ``fsync`` of the folder): a file at ``PATH``
was written whole. A full disk, or any write error, is a :class:`TableFileError` and leaves no file behind.

Opened (:meth:`TableFile.open`): the header is checked (magic, version, layout, ``complete``, the file's size
against the layout) and the sums are read (4 bytes a page: 48 MiB for a 48 GiB table); the data is never
read at open. Reads (:meth:`TableFile.read_pages`, :meth:`TableFile.read_rows`) take whole pages with
``pread`` (``O_DIRECT`` where the filesystem allows it, else the page cache, advised random) and check each
page against its sum: a short read (a file truncated under the table), an I/O error or a sum that does not
match is a :class:`TableFileError` that names the file and the page; a row outside the table is refused
before any read. The file is read through the descriptor opened at open: a file renamed over ``PATH`` later
is not seen (the table keeps serving the bytes it checked). This reader issues one ``pread`` per run of
adjacent pages on the calling thread: the reference the batched reader of the disk placement is checked
against.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import threading
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from uvaple.dtypes import SAFETENSORS_DTYPES, TABLE_DTYPES, dtype_name, fmt_bytes

from . import system
from .errors import UvapleError
from .memory import row_stride_bytes
from .workers import default_threads, parallel

__all__ = ["TableFile", "FileLayout", "TableFileError", "RowSource", "write_table_file", "remove_dead_partials", "PAGE",
           "MAGIC", "fitting_source"]

PAGE = 4096
MAGIC = b"UVAPLE-TABLE\x00\x00v1"
VERSION = 1
_WRITE_PAGES = 256  # data pages a writer thread fills and writes at a time (1 MiB)


class TableFileError(UvapleError):
    """A table file cannot be written, opened or read as its header says (the message names the file, and the
    page where one is at fault)."""


@dataclass(frozen=True)
class FileLayout:
    """Where each row of a table file lies (see the module docstring)."""

    rows: int
    cols: int
    dtype: torch.dtype
    encoding: str
    row_bytes: int
    stride: int
    rows_per_page: int  # rows packed in a page (0: a row takes pages_per_row pages)
    pages_per_row: int  # pages a row takes (0: rows are packed)
    data_pages: int

    @classmethod
    def of(cls, rows: int, cols: int, dtype: torch.dtype, encoding: str = "raw") -> FileLayout:
        if dtype not in TABLE_DTYPES:
            raise TableFileError(f"a table file holds rows of {[str(d) for d in TABLE_DTYPES]}, not {dtype}")
        for name, value in (("rows", rows), ("cols", cols)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TableFileError(f"a table file needs {name} >= 1, got {value!r}")
        if not isinstance(encoding, str) or not encoding or len(encoding) > 64:
            raise TableFileError(f"encoding must be the name of the rows' encoding ('raw', 'fp8_row', ...), got "
                                 f"{encoding!r}")
        row_bytes = cols * dtype.itemsize
        stride = row_stride_bytes(row_bytes)
        if stride <= PAGE:
            per = PAGE // stride
            return cls(rows, cols, dtype, encoding, row_bytes, stride, per, 0, -(-rows // per))
        pages = -(-stride // PAGE)
        return cls(rows, cols, dtype, encoding, row_bytes, stride, 0, pages, rows * pages)

    @property
    def sums_pages(self) -> int:
        return -(-self.data_pages * 4 // PAGE)

    @property
    def file_bytes(self) -> int:
        return (1 + self.data_pages + self.sums_pages) * PAGE

    def pages_of(self, row_lo: int, row_hi: int) -> tuple[int, int]:
        """The data pages ``[first, last)`` that rows ``row_lo .. row_hi - 1`` lie in."""
        if row_hi <= row_lo:
            return row_lo, row_lo  # (no page)
        if self.rows_per_page:
            return row_lo // self.rows_per_page, -(-row_hi // self.rows_per_page)
        return row_lo * self.pages_per_row, row_hi * self.pages_per_row

    def rows_of(self, page_lo: int, page_hi: int) -> tuple[int, int]:
        """The rows ``[first, last)`` that data pages ``page_lo .. page_hi - 1`` hold."""
        if self.rows_per_page:
            return page_lo * self.rows_per_page, min(self.rows, page_hi * self.rows_per_page)
        return page_lo // self.pages_per_row, -(-page_hi // self.pages_per_row)

    def header(self, complete: bool, source: str | None = None) -> bytes:
        meta = {k: v for k, v in asdict(self).items() if k != "dtype"}
        meta.update(version=VERSION, dtype=dtype_name(self.dtype), complete=complete)
        if source is not None:
            meta["source"] = source
        body = MAGIC + json.dumps(meta, sort_keys=True).encode()
        return body + bytes(PAGE - len(body))

    @classmethod
    def from_header(cls, page: bytes, path: str) -> tuple[FileLayout, bool, str | None]:
        if page[: len(MAGIC)] != MAGIC:
            raise TableFileError(f"{path} is not a uvaple table file (its first bytes are not {MAGIC!r}); write one "
                                 "with uvaple.uva.table_file.write_table_file")
        try:
            meta = json.loads(page[len(MAGIC):].rstrip(b"\0").decode())
            if not isinstance(meta, dict):
                raise ValueError(f"the header holds a {type(meta).__name__}, not an object")
            if meta.get("version") != VERSION:
                raise TableFileError(f"{path} is a table file of version {meta.get('version')!r}; this uvaple reads "
                                     f"version {VERSION}: write it again")
            layout = cls.of(meta["rows"], meta["cols"], SAFETENSORS_DTYPES[meta["dtype"]], meta["encoding"])
            complete = meta["complete"] is True
            source = meta.get("source")
            if source is not None and not isinstance(source, str):
                raise TypeError(f"its source is a {type(source).__name__}, not a string")
        except TableFileError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise TableFileError(f"{path}: its header is damaged ({type(e).__name__}: {e}); write the file "
                                 "again") from None
        stored = {k: meta.get(k) for k in ("row_bytes", "stride", "rows_per_page", "pages_per_row", "data_pages")}
        want = {k: getattr(layout, k) for k in stored}
        if stored != want:
            raise TableFileError(f"{path}: its header's layout {stored} is not the layout of its shape {want}; write "
                                 "the file again")
        return layout, complete, source


# ------------------------------------------------------------------ writing
@dataclass(frozen=True)
class RowSource:
    """Rows a table file is written from, block by block: ``block(a, b)`` gives rows ``a .. b - 1`` as a
    ``[b - a, cols]`` CPU tensor of ``dtype`` (called from the writing threads, each block once).
    :meth:`of` makes one of anything :func:`write_table_file` takes, to compute other rows from (a quantiser)."""

    rows: int
    cols: int
    dtype: torch.dtype
    block: Callable[[int, int], torch.Tensor]

    @classmethod
    def of(cls, source) -> RowSource:
        """The rows of a 2-D CPU tensor, a HostTable, a safetensors TensorInfo or a RowSource."""
        return _row_source(source)

    @classmethod
    def stacked(cls, sources) -> RowSource:
        """The rows of ``sources`` one after another (a table saved as row shards): each of what :meth:`of`
        takes, all of one width and dtype (a TableFileError names the first that is not)."""
        sources = list(sources)
        parts = [cls.of(x) for x in sources]
        if not parts:
            raise TableFileError("no sources to stack")
        for i, x in enumerate(parts):
            if (x.cols, x.dtype) != (parts[0].cols, parts[0].dtype):
                first, this = (getattr(sources[k], "name", None) or f"source {k}" for k in (0, i))  # a tensor's name
                raise TableFileError(f"{this} holds rows of {x.cols} {x.dtype} values and {first} rows of "
                                     f"{parts[0].cols} {parts[0].dtype}: stacked sources need one row layout")
        if len(parts) == 1:
            return parts[0]
        starts = np.cumsum([0] + [x.rows for x in parts])

        def block(a: int, b: int) -> torch.Tensor:
            out = []
            for i in range(int(np.searchsorted(starts, a, side="right")) - 1, len(parts)):
                lo, hi = max(a, int(starts[i])), min(b, int(starts[i + 1]))
                if lo >= b:
                    break
                if lo < hi:
                    out.append(parts[i].block(lo - int(starts[i]), hi - int(starts[i])))
            return out[0] if len(out) == 1 else torch.cat(out)

        return cls(int(starts[-1]), parts[0].cols, parts[0].dtype, block)


def _row_source(source) -> RowSource:
    """:meth:`RowSource.of`."""
    from .host_table import HostTable
    from .loading import TensorInfo

    if isinstance(source, RowSource):
        return source
    if isinstance(source, HostTable):
        source = source.tensor
    if isinstance(source, torch.Tensor):
        if source.dim() != 2 or source.device.type != "cpu" or source.stride(1) != 1:
            raise TableFileError(f"a table file is written from a 2-D CPU tensor with unit column stride, a HostTable "
                                 f"or a safetensors tensor; got a tensor of shape {tuple(source.shape)} on "
                                 f"{source.device}")
        src = source
        return RowSource(src.shape[0], src.shape[1], src.dtype, lambda a, b: src[a:b])
    if isinstance(source, TensorInfo):
        info = source
        if len(info.shape) != 2:
            raise TableFileError(f"{info.path}: {info.name} has shape {info.shape}; a table is 2-D")

        def block(a: int, b: int) -> torch.Tensor:
            out = torch.empty((b - a, info.shape[1]), dtype=info.dtype)
            fd = os.open(info.path, os.O_RDONLY)
            try:
                _read_exact(fd, out.view(torch.uint8).reshape(-1), info.begin + a * info.row_bytes, info.path,
                            what=f"{info.name}'s rows {a} .. {b - 1}")
            finally:
                os.close(fd)
            return out

        return RowSource(info.shape[0], info.shape[1], info.dtype, block)
    raise TableFileError(f"a table file is written from a 2-D CPU tensor, a HostTable, a safetensors tensor "
                         f"(uvaple.uva.loading.locate_tensor) or a RowSource, not {type(source).__name__}")


#: the longest ``source`` a header holds (characters)
MAX_SOURCE = 1024


def fitting_source(*texts: str | None) -> str | None:
    """The first of ``texts`` that fits the header's source field (:data:`MAX_SOURCE` characters as JSON); None
    where none does (a writer then names no source)."""
    return next((t for t in texts if t is not None and len(json.dumps(t)) <= MAX_SOURCE + 2), None)


def write_table_file(path: str | os.PathLike, source, *, encoding: str = "raw", overwrite: bool = False,
                     threads: int | None = None, progress: Callable[[int, int], None] | None = None,
                     source_id: str | None = None) -> FileLayout:
    """Write ``source`` (a 2-D CPU tensor, a HostTable, or a safetensors tensor from
    :func:`uvaple.uva.loading.locate_tensor`) as a table file at ``path`` (see the module docstring); returns its
    layout. ``encoding`` names how the rows are stored (the integration layer checks it against its registry).
    ``progress(rows_done, rows)`` is called as blocks land, from the writing threads. An existing ``path`` is
    refused unless ``overwrite``; a symbolic link is written through (its target gets the table). ``source_id``
    (at most :data:`MAX_SOURCE` characters in the header's JSON, where a non-ASCII character takes six) is kept in
    the header as :attr:`TableFile.source`: what the rows were written from, for a reader that reuses the file to
    compare."""
    path = os.fspath(path)
    if os.path.islink(path):  # written through: the link's target gets the table, the link stays
        path = os.path.realpath(path)
    src = RowSource.of(source)
    rows, cols, dtype, block = src.rows, src.cols, src.dtype, src.block
    layout = FileLayout.of(rows, cols, dtype, encoding)
    if source_id is not None and (not isinstance(source_id, str) or len(json.dumps(source_id)) > MAX_SOURCE + 2):
        raise TableFileError(f"source_id must be a string of at most {MAX_SOURCE} characters as the header's JSON "
                             f"writes it (a non-ASCII character takes 6), got {source_id!r:.80}")
    if os.path.exists(path) and not overwrite:
        raise TableFileError(f"{path} exists: pass overwrite=True to replace it, or another path")
    if os.path.isdir(path):
        raise TableFileError(f"{path} is a directory: give the table file's own path")
    remove_dead_partials(path)
    partial = f"{path}.partial.{os.getpid()}"
    threads = max(1, threads or default_threads())
    sums = np.zeros(layout.sums_pages * PAGE // 4, dtype="<u4")
    done, lock = [0], threading.Lock()
    try:
        fd = os.open(partial, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise TableFileError(f"cannot create {partial}: {e.strerror}") from None
    try:
        try:
            os.posix_fallocate(fd, 0, layout.file_bytes)  # a full disk fails here, before anything is written
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, layout.file_bytes)
        _pwrite(fd, layout.header(complete=False), 0, partial)

        def write_pages(p0: int, n: int) -> None:
            buf = bytearray(n * PAGE)
            view = np.frombuffer(buf, dtype=np.uint8).reshape(n, PAGE)
            r0, r1 = layout.rows_of(p0, p0 + n)
            try:
                got = block(r0, r1)
            except (OSError, UvapleError, ValueError, TypeError) as e:  # the source, not the file being written
                raise TableFileError(f"reading rows {r0} .. {r1 - 1} of the source failed: "
                                     f"{getattr(e, 'strerror', None) or e}") from None
            if not isinstance(got, torch.Tensor) or got.dtype != dtype or tuple(got.shape) != (r1 - r0, cols) \
                    or got.device.type != "cpu":
                raise TableFileError(f"the source gave rows {r0} .. {r1 - 1} as {_described(got)}; expected a CPU "
                                     f"{dtype} tensor of shape {(r1 - r0, cols)}")
            rows_bytes = got.contiguous().view(torch.uint8).reshape(r1 - r0, layout.row_bytes).numpy()
            if layout.rows_per_page:  # a page's rows at the host stride, the rest of the page zero
                i = np.arange(r1 - r0)
                at = (i // layout.rows_per_page) * PAGE + (i % layout.rows_per_page) * layout.stride
                view.reshape(-1)[at[:, None] + np.arange(layout.row_bytes)] = rows_bytes
            else:
                flat = view.reshape(r1 - r0, layout.pages_per_row * PAGE)
                flat[:, : layout.row_bytes] = rows_bytes
            for i in range(n):
                sums[p0 + i] = zlib.crc32(view[i])
            _pwrite(fd, buf, (1 + p0) * PAGE, partial)
            if progress is not None:
                with lock:
                    done[0] += r1 - r0
                    progress(done[0], rows)

        step = _WRITE_PAGES if layout.rows_per_page else max(layout.pages_per_row, _WRITE_PAGES // layout.pages_per_row
                                                             * layout.pages_per_row)
        ranges = [(p, min(step, layout.data_pages - p)) for p in range(0, layout.data_pages, step)]
        parallel(write_pages, ranges, threads, name="uvaple-table-file")
        _pwrite(fd, sums.tobytes(), (1 + layout.data_pages) * PAGE, partial)
        os.fsync(fd)
        _pwrite(fd, layout.header(complete=True, source=source_id), 0, partial)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(partial, path)  # the file at path is whole, or there is none
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise TableFileError(f"no space left on the disk of {partial} for a table file of "
                                 f"{fmt_bytes(layout.file_bytes)}: free that much, or write it elsewhere") from None
        if isinstance(e, OSError):
            raise TableFileError(f"writing {path} failed: {e.strerror or e}") from None
        raise
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename is on disk too
    finally:
        os.close(folder)
    return layout


def remove_dead_partials(path: str | os.PathLike, kind: str = "partial", dry_run: bool = False) -> list[str]:
    """Remove the partial files a writer of ``path`` left when it was killed (``PATH.<kind>.<pid>`` of a process
    that no longer runs; a live writer's is kept); returns their paths (``dry_run``: found, not removed)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    prefix = f"{name}.{kind}."
    for entry in entries:
        pid = entry[len(prefix):]
        if not entry.startswith(prefix) or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        if dry_run:
            removed.append(os.path.join(folder, entry))
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, entry))
            removed.append(os.path.join(folder, entry))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _described(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return f"a {type(t).__name__}"


def _pwrite(fd: int, data, offset: int, path: str) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"{path}: pwrite wrote nothing at byte {offset}")
        view, offset = view[n:], offset + n


# ------------------------------------------------------------------ reading
def page_buffer(pages: int) -> torch.Tensor:
    """A page-aligned ``uint8 [pages, PAGE]`` CPU tensor (anonymous memory: what ``O_DIRECT`` reads into)."""
    block = mmap.mmap(-1, max(1, pages) * PAGE)
    return torch.frombuffer(block, dtype=torch.uint8)[: pages * PAGE].view(pages, PAGE)


class TableFile:
    """A table file opened for reading (see the module docstring): :attr:`layout`, :meth:`read_pages`,
    :meth:`read_rows`, :meth:`verify`, :meth:`close` (also a context manager)."""

    def __init__(self, path: str, fd: int, layout: FileLayout, sums: np.ndarray, direct: bool,
                 source: str | None = None) -> None:
        self.path, self._fd, self.layout, self._sums, self.direct = path, fd, layout, sums, direct
        #: what the rows were written from, as the writer named it (``write_table_file``'s ``source_id``), or None
        self.source = source
        self.owner_pid = os.getpid()
        self._closed = False

    # the table's shape as a HostTable of its rows has it (what TableSpec.of and a lookup read)
    @property
    def rows(self) -> int:
        return self.layout.rows

    @property
    def cols(self) -> int:
        return self.layout.cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.layout.rows, self.layout.cols)

    @property
    def dtype(self) -> torch.dtype:
        return self.layout.dtype

    @property
    def stride(self) -> int:
        """Elements between two rows as a host table holds them (the file's row stride)."""
        return self.layout.stride // self.layout.dtype.itemsize

    @property
    def encoding(self) -> str:
        """The rows' encoding, as the file's header names it."""
        return self.layout.encoding

    @property
    def forked(self) -> bool:
        """True in a process forked after the file was opened (its descriptor's offset and the caches built on
        it are the parent's)."""
        return os.getpid() != self.owner_pid

    @classmethod
    def open(cls, path: str | os.PathLike, *, direct: bool | None = None) -> TableFile:
        """Open ``path``: check its header and size, read its sums (never its data). ``direct``: read with
        ``O_DIRECT`` (None: where the filesystem allows it)."""
        path = os.fspath(path)
        # one descriptor checks the file and reads it: with O_DIRECT where the filesystem allows it (the header
        # and the sums are read into page-aligned buffers at page offsets too), so a file renamed over the path
        # after the check is never read against the sums of the one before
        fd = None if direct is False else _open_direct(path)
        if fd is None and direct:
            raise TableFileError(f"{path}: its filesystem refuses O_DIRECT; open it with direct=None or False")
        is_direct = fd is not None
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise TableFileError(f"cannot open the table file {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < PAGE:
                raise TableFileError(f"{path} ended at byte {size} while reading the header (not a table file, "
                                     "or truncated): write it again")
            head = page_buffer(1)
            _read_exact(fd, head, 0, path, what="the header")
            layout, complete, source = FileLayout.from_header(bytes(head.numpy()), path)
            if not complete:
                raise TableFileError(f"{path} was not written to the end (its header does not say complete): write "
                                     "it again")
            if size != layout.file_bytes:
                raise TableFileError(f"{path} holds {size:,} bytes; its layout needs {layout.file_bytes:,} (truncated "
                                     "or appended to): write it again")
            sums_buf = page_buffer(layout.sums_pages)
            _read_exact(fd, sums_buf, (1 + layout.data_pages) * PAGE, path, what="the page sums")
            sums = sums_buf.numpy().reshape(-1).view("<u4")[: layout.data_pages].copy()
        except BaseException:
            os.close(fd)
            raise
        if not is_direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # the page cache, read ahead by nothing
        return cls(path, fd, layout, sums, direct=is_direct, source=source)

    def duplicate(self) -> TableFile:
        """Another open table of the same file, read through a duplicate of this one's descriptor: the bytes this
        table checked, whatever has been written at :attr:`path` since (closed on its own)."""
        self._check_open()
        return TableFile(self.path, os.dup(self._fd), self.layout, self._sums.copy(), self.direct, self.source)

    def fileno(self) -> int:
        """The descriptor the file is read through (``O_DIRECT`` where :attr:`direct`)."""
        self._check_open()
        return self._fd

    @property
    def page_sums(self) -> np.ndarray:
        """Each data page's CRC-32 (uint32, read at open; read-only)."""
        sums = self._sums.view()
        sums.flags.writeable = False
        return sums

    def _check_open(self) -> None:
        if self._closed:
            raise TableFileError(f"the table file {self.path} was closed")

    def read_pages(self, pages, out: torch.Tensor) -> torch.Tensor:
        """Data pages ``pages`` (a sequence or 1-D tensor of page numbers) into ``out`` (``uint8 [n, PAGE]``,
        page-aligned where :attr:`direct`: :func:`page_buffer`), each checked against its sum."""
        self._check_open()
        pages = np.asarray(torch.as_tensor(pages, dtype=torch.int64).reshape(-1))
        if out.dtype != torch.uint8 or tuple(out.shape) != (len(pages), PAGE) or not out.is_contiguous():
            raise TableFileError(f"out must be a contiguous uint8 [{len(pages)}, {PAGE}] tensor, got {out.dtype} "
                                 f"{tuple(out.shape)}")
        if len(pages) and (pages.min() < 0 or pages.max() >= self.layout.data_pages):
            raise TableFileError(f"{self.path} has data pages 0 .. {self.layout.data_pages - 1}; asked for "
                                 f"{int(pages.min())} .. {int(pages.max())}")
        if self.direct and out.data_ptr() % PAGE:
            raise TableFileError("out must be page-aligned for direct reads: make it with page_buffer()")
        i = 0
        while i < len(pages):  # one pread per run of adjacent pages that land in adjacent rows of out
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1:
                j += 1
            _read_exact(self._fd, out[i:j], (1 + int(pages[i])) * PAGE, self.path,
                        what=f"data pages {int(pages[i])} .. {int(pages[j - 1])}")
            i = j
        for k, page in enumerate(pages):
            if zlib.crc32(out[k].numpy()) != int(self._sums[page]):
                raise TableFileError(f"{self.path}: data page {int(page)} does not match its sum (the file was "
                                     "changed or damaged after it was written): delete it and write it again (a "
                                     "model's loader reuses a table file by its header alone)")
        return out

    def read_rows(self, rows, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``rows`` (a sequence or 1-D tensor, any order, repeats allowed) as ``[n, cols]`` of the table's
        dtype (in ``out`` when given), through the pages they lie in (each read once)."""
        self._check_open()
        lay = self.layout
        rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= lay.rows):
            raise TableFileError(f"{self.path} has rows 0 .. {lay.rows - 1}; asked for {int(rows.min())} .. "
                                 f"{int(rows.max())}")
        if out is None:
            out = torch.empty((rows.numel(), lay.cols), dtype=lay.dtype)
        elif out.dtype != lay.dtype or tuple(out.shape) != (rows.numel(), lay.cols) or not out.is_contiguous():
            raise TableFileError(f"out must be a contiguous {lay.dtype} [{rows.numel()}, {lay.cols}] tensor, got "
                                 f"{out.dtype} {tuple(out.shape)}")
        if not rows.numel():
            return out
        if lay.rows_per_page:
            first = rows // lay.rows_per_page
            pages, where = torch.unique(first, return_inverse=True)
            buf = self.read_pages(pages, page_buffer(len(pages)))
            at = where * PAGE + (rows % lay.rows_per_page) * lay.stride  # each row's first byte in buf
            dst = out.view(torch.uint8).reshape(rows.numel(), lay.row_bytes)
            dst.copy_(buf.reshape(-1)[at[:, None] + torch.arange(lay.row_bytes)])
        else:
            distinct, where = torch.unique(rows, return_inverse=True)
            pages = (distinct[:, None] * lay.pages_per_row + torch.arange(lay.pages_per_row)).reshape(-1)
            buf = self.read_pages(pages, page_buffer(len(pages))).view(len(distinct), lay.pages_per_row * PAGE)
            out.view(torch.uint8).reshape(rows.numel(), lay.row_bytes).copy_(buf[where, : lay.row_bytes])
        return out

    def verify(self, *, progress: Callable[[int, int], None] | None = None, pages_per_read: int = 256) -> None:
        """Read every data page and check it against its sum (a TableFileError names the first that fails)."""
        self._check_open()
        total = self.layout.data_pages
        buf = page_buffer(min(pages_per_read, total))
        for p in range(0, total, pages_per_read):
            n = min(pages_per_read, total - p)
            self.read_pages(range(p, p + n), buf[:n])
            if progress is not None:
                progress(p + n, total)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TableFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def _open_direct(path: str) -> int | None:
    """A descriptor of ``path`` with ``O_DIRECT``, or None where the filesystem (tmpfs) or the OS refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise TableFileError(f"cannot open the table file {path}: {e.strerror}") from None


def _read_exact(fd: int, out: torch.Tensor, offset: int, path: str, *, what: str) -> None:
    """Fill ``out`` (uint8, contiguous) from ``offset``: a short read or an I/O error is a named error."""
    view = memoryview(out.numpy()).cast("B")
    try:
        got = system.pread_full(fd, [view], offset)
    except OSError as e:
        raise TableFileError(f"{path}: reading {what} failed at byte {offset}: {e.strerror}") from None
    if got < view.nbytes:
        raise TableFileError(f"{path} ended at byte {offset + got} while reading {what} (truncated after it "
                             "was written?): write it again")
