"""An embedding whose rows are a table file on local disk, served by a placement that reads files (``disk``).

For tables larger than the host memory a server can give them (Qwen4Exp's n-gram tables: ~95 GiB in bf16).
:class:`FileEmbedding` is a :class:`~uvaple.integration.embedding.HostScaledEmbedding` (same module API:
lookups per device, ``max_tokens``, ``close()``, ``model.to(...)``) whose table is a
:class:`~uvaple.uva.TableFile` instead of a host table: each lookup is the placement's
(:class:`~uvaple.integration.placements.disk.DiskLookup`: a host row cache of ``budget_bytes`` in front of the
file; its ``backend_options``: ``budget_bytes`` or ``slots``, ``steps_in_flight``, ``wait_s``, ``read_depth``,
``read_timeout_s``, ``hot_rows``). The file's rows are:

* ``raw``: the rows as the checkpoint holds them (the module's scale applied by the gather, as for a host table);
* ``fp8_row``: quantised when the file was written (``backend_options["quantize"]``), half the bytes of bf16;
* ``fp8_global``: an fp8 checkpoint's codes as stored, with the module's ``weight_scale``.

Where the file comes from (:func:`table_file_for`): written once from a :class:`~uvaple.uva.RowSource` (a
checkpoint's shards, a live module's table, block by block: nothing of the table's size is held in memory), its
header naming the source (``source_id``: what was read, and the encoding); a later load whose source is the
same opens the file without reading its data, one whose source differs writes it again. A module built with a
``table_path`` writes its file when its weight is assigned (transformers' loader, ``load_state_dict``,
:meth:`FileEmbedding.load_weight_`).

A serving copy of the rows: ``weight`` is a meta tensor (the rows are on disk) and the state dict carries no
``weight`` (save the model from its checkpoint); :meth:`FileEmbedding.read_table` reads the whole table back
(what ``revert()`` gives a live model).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import time
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from uvaple.dtypes import fmt_bytes
from uvaple.kernels.encodings import ENCODINGS
from uvaple.uva import RowSource, TableFile, TableFileError, write_table_file

from .embedding import BACKENDS, QUANTIZE, HostScaledEmbedding, _exact_scale, _excluded
from .factory import placement
from .spec import TableSpec

__all__ = ["FileEmbedding", "table_file_for", "reusable", "check_options", "make_folder", "folder_lock",
           "FILE_ENCODINGS",
           "MODULE_OPTIONS", "LOADER_OPTIONS"]

log = logging.getLogger("uvaple.integration.file_embedding")

#: how often a table file being written says how far it is (seconds)
PROGRESS_EVERY_S = 10.0
#: the encodings a file embedding serves
FILE_ENCODINGS = ("raw", "fp8_row", "fp8_global")
#: ``backend_options`` a model's entry point consumes (where its table files go, whether its source is kept)
LOADER_OPTIONS = ("table_dir", "keep_source")
#: ``backend_options`` the module (or the model's entry point) consumes, never passed to the placement
MODULE_OPTIONS = ("quantize", *LOADER_OPTIONS)


def _width(encoding: str, dim: int) -> int:
    """Stored columns of a row of ``dim`` values in ``encoding`` (fp8 codes: one byte each, then the trailer)."""
    return dim + ENCODINGS[encoding].trailer


def check_options(backend: str, backend_options: dict | None, *, max_rows: int | None = None,
                  row_bytes: int | None = None) -> dict:
    """The placement's own options of ``backend_options`` (the module's, :data:`MODULE_OPTIONS`, left out),
    checked by its entry (an option it does not take, a bad value, a cache too small for ``max_rows`` rows of
    ``row_bytes``: named errors), for a caller that writes table files before any lookup is built."""
    options = {k: v for k, v in (backend_options or {}).items() if k not in MODULE_OPTIONS}
    placement(backend).check_options(options, max_rows=max_rows, row_bytes=row_bytes)
    return options


def reusable(path: str | os.PathLike, rows: RowSource, encoding: str, source_id: str | None) -> TableFile | None:
    """The table file at ``path``, opened, where it is complete and holds ``rows`` as its header says (written from
    ``source_id``, in ``encoding``, of their shape and dtype); else None (also without a ``source_id``). A file
    reused has its modification time set to now: ``uvaple table prune`` removes the files unused for days."""
    if source_id is None or not os.path.exists(path):
        return None
    try:
        file = TableFile.open(path)
    except Exception as e:  # a damaged or partial file: not reused
        log.warning("uvaple: %s cannot be reused (%s)", path, e)
        return None
    if (file.source, file.shape, file.dtype, file.encoding) == (source_id, (rows.rows, rows.cols), rows.dtype,
                                                                encoding):
        try:  # reused now: its modification time says so (uvaple table prune)
            os.utime(path)
        except OSError as e:
            log.warning("uvaple: %s is reused but cannot be stamped as used (%s): uvaple table prune will count it "
                        "unused", path, e.strerror or e)
        return file
    file.close()
    return None


def table_file_for(path: str | os.PathLike, rows: RowSource, *, encoding: str = "raw",
                   source_id: str | None = None, what: str = "a table") -> TableFile:
    """The table file at ``path`` holding ``rows`` (already in ``encoding``), opened.

    With ``source_id`` (what ``rows`` are read from: a checkpoint's tensors and their files, the encoding), a
    complete file there whose header names the same source and layout is opened as it is (no data read);
    otherwise the file is written (replacing one there, whose source differs), then opened. Without a
    ``source_id`` (a live module's rows: nothing identifies them) the file is always written."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    make_folder(folder)
    with folder_lock(folder):  # one writer a folder: another process loading the same files waits, then reuses
        file = reusable(path, rows, encoding, source_id)  # (written before, or by that process meanwhile)
        if file is not None:
            log.info("uvaple: %s <- %s (the table file written before, from the same source)", what, path)
            return file
        if os.path.exists(path):
            log.warning("uvaple: %s does not hold %s as its header names them: writing it again", path, what)
        started = time.monotonic()
        log.info("uvaple: writing %s to %s (%d rows, %s)", what, path, rows.rows, encoding)
        bar = tqdm(total=rows.rows, desc=f"uvaple: writing {what}", unit="row", unit_scale=True, delay=2.0,
                   leave=False, file=sys.stderr)
        try:
            layout = write_table_file(path, rows, encoding=encoding, overwrite=True, source_id=source_id,
                                      progress=_progress(what, started, bar))
        finally:
            bar.close()
        took = time.monotonic() - started
        log.info("uvaple: wrote %s of %s in %.1f s (%s/s)", fmt_bytes(layout.file_bytes), what, took,
                 fmt_bytes(int(layout.file_bytes / max(took, 1e-9))))
        return TableFile.open(path)


@contextlib.contextmanager
def folder_lock(folder: str, wait: bool = True) -> Iterator[None]:
    """An exclusive lock on ``folder`` (``flock`` on the folder itself: released by the kernel when this process
    ends, however it ends), held while a table file there is checked and written, or pruned (``uvaple table
    prune``). Held by another process: waited for, or (``wait=False``) BlockingIOError."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise
            log.warning("uvaple: another process is writing table files in %s: waiting for it", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def make_folder(folder: str) -> None:
    """``folder`` made where it is missing; a TableFileError naming it where it cannot be."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise TableFileError(f"cannot make the folder {folder} for table files: {e.strerror or e}; give a folder "
                             "this process can write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise TableFileError(f"the folder {folder} for table files is not writable by this process; give a folder "
                             "it can write")


def _progress(what: str, started: float, bar, every_s: float = PROGRESS_EVERY_S):
    """A writer's ``progress(done, total)``: ``bar`` (a progress bar on stderr, shown once the write has taken two
    seconds) moved on, and a log line of how far it is at most every ``every_s`` seconds (a table of tens of GiB
    takes minutes)."""
    last, seen = [started], [0]

    def progress(done: int, total: int) -> None:  # called under the writer's lock
        bar.update(done - seen[0])
        seen[0] = done
        now = time.monotonic()
        if now - last[0] >= every_s and done < total:
            last[0] = now
            log.info("uvaple: writing %s: %d of %d rows (%.0f%%) in %.0f s", what, done, total, 100 * done / total,
                     now - started)

    return progress


def _tensor_rows(weight: torch.Tensor) -> RowSource:
    """A tensor's rows (any device) as a writer reads them: each block copied to the CPU as it is asked for."""
    weight = weight.detach()
    if weight.device.type == "cpu":
        return RowSource.of(weight if weight.stride(-1) == 1 else weight.contiguous())
    return RowSource(weight.shape[0], weight.shape[1], weight.dtype, lambda a, b: weight[a:b].cpu())


class FileEmbedding(HostScaledEmbedding):
    """An embedding whose rows are a table file (see the module docstring).

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        The values a lookup returns: ``[num_embeddings, embedding_dim]``.
    file : TableFile, optional
        The rows (``raw``, ``fp8_row`` or ``fp8_global``, :data:`FILE_ENCODINGS`); without it the module is empty
        until :meth:`attach_table` or an assigned weight (with ``table_path``) gives it one.
    out_dtype : torch.dtype
        The model's dtype (follows ``model.to(dtype)``).
    embed_scale : float
        The output scale of a ``raw`` file's rows (an encoded file holds its rows as served: ``quantize`` with a
        scale other than 1 is refused).
    weight_scale : tensor, optional
        ``fp8_global``: the table's scale (one value).
    table_path : str, optional
        Where an assigned weight is written (in ``backend_options["quantize"]``'s encoding, ``raw`` without).
    backend, oob, backend_options, register, max_tokens :
        As for :class:`HostScaledEmbedding`; ``backend`` is a placement that reads table files, and
        ``max_tokens`` is required (the placement stages each call's ids).
    own_file : bool
        Whether :meth:`close` closes ``file`` (default True).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, file: TableFile | None = None, *,
                 out_dtype: torch.dtype, embed_scale: float = 1.0, weight_scale: torch.Tensor | None = None,
                 table_path: str | os.PathLike | None = None, backend: str = "disk", oob: str = "zero",
                 backend_options: dict | None = None, register="auto", max_tokens: int | None = None,
                 own_file: bool = True):
        self._check_backend(backend)
        if max_tokens is None:
            raise ValueError(f"the {backend} placement stages each call's ids in pinned memory sized once: build the "
                             "embedding with max_tokens (the most ids a forward brings)")
        check_options(backend, backend_options)  # named now, not at the first forward
        if (backend_options or {}).get("quantize") is not None and embed_scale != 1.0:
            raise ValueError(f"a file embedding quantises its rows as they are, not times embed_scale={embed_scale}: "
                             "write the file raw (no quantize), or quantise the scaled rows into it yourself")
        if weight_scale is not None and (not isinstance(weight_scale, torch.Tensor) or weight_scale.numel() != 1
                                         or not weight_scale.dtype.is_floating_point):
            raise ValueError(f"weight_scale must be a float tensor of one value (an fp8_global table's scale), got "
                             f"{weight_scale!r:.80}")
        super().__init__(num_embeddings, embedding_dim, None, embed_scale, backend=backend, oob=oob, dtype=out_dtype,
                         backend_options=backend_options, register=register, materialize=False, max_tokens=max_tokens)
        self.table_path = None if table_path is None else os.fspath(table_path)
        if weight_scale is not None:
            self.register_buffer("weight_scale", torch.as_tensor(weight_scale, dtype=torch.float32).reshape(1).clone())
        if file is not None:
            self.attach_table(file, own=own_file)

    def _check_backend(self, backend: str) -> None:
        if not isinstance(backend, str) or backend not in BACKENDS or not placement(backend).reads_file:
            raise ValueError(f"this embedding's rows are a table file: it is served by {list(_file_placements())}, "
                             f"not {backend!r}")

    # ------------------------------------------------------------------ table
    @property
    def encoding(self) -> str | None:
        """The file's row encoding (None until a file is attached)."""
        return None if self._table is None else self._table.encoding

    def attach_table(self, table: TableFile, *, own: bool = False) -> None:
        """Serve ``table`` (a :class:`~uvaple.uva.TableFile` of this module's rows) from now on; ``own``:
        :meth:`close` closes it."""
        if not isinstance(table, TableFile):
            raise TypeError(f"a file embedding serves a table file (uvaple.uva.TableFile), not {type(table).__name__}")
        enc = table.encoding
        if enc not in FILE_ENCODINGS:
            raise ValueError(f"{table.path} holds {enc!r} rows; a file embedding serves {list(FILE_ENCODINGS)}")
        if enc == "raw" and (not table.dtype.is_floating_point or table.dtype.itemsize < 2):
            raise ValueError(f"{table.path} holds raw {table.dtype} rows; a file embedding serves raw rows of bf16, "
                             "fp16 or fp32 (fp8 codes are fp8_row or fp8_global files)")
        cols = _width(enc, self.embedding_dim)
        if table.shape != (self.num_embeddings, cols):
            raise ValueError(f"{table.path} is {table.rows}x{table.cols} ({enc}); this embedding's rows are "
                             f"{self.num_embeddings}x{cols} in that encoding")
        if (enc == "fp8_global") != hasattr(self, "weight_scale"):
            raise ValueError(f"{table.path} holds {enc} rows: an fp8_global file needs the embedding's weight_scale "
                             "(and only it does)")
        check_options(self.backend_kind, self.backend_options, max_rows=self.max_tokens,
                      row_bytes=table.layout.row_bytes)  # its cache holds a forward's rows
        old, old_own = self._table, self._own_table
        self._close_backends()
        if enc == "raw" and table.dtype != self.table_dtype:  # the scale as HF rounds it to the rows' dtype
            self.table_dtype = table.dtype
            self.scale_value = _exact_scale(self.scalar_embed_scale, table.dtype)
        self._table, self._own_table = table, own
        if old is not None and old is not table and old_own:
            old.close()

    def _lookup_for(self, device: torch.device):
        if self._table is None:
            raise RuntimeError("this FileEmbedding has no table file yet: attach one (attach_table), assign its "
                               "weight (written to table_path), or load the model with its loader (for Qwen4Exp "
                               "load_qwen4_exp_with_host_ple(path, backend='disk', ...))")
        return super()._lookup_for(device)

    def lookup_on(self, device: torch.device):
        """The lookup serving ``device`` (built on first use): what a read round reads ahead through
        (:class:`~uvaple.integration.placements.read_round.ReadRound`)."""
        return self._lookup_for(device)[0]

    def forward_host_ids(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """:meth:`forward` of ids the host holds already (``ids`` on the CPU, such as a read round's), the rows on
        ``device``: the ids are not copied there and back, and the call waits for nothing (its lookup plans from
        them as they are). ``max_tokens`` bounds them as for :meth:`forward`."""
        lookup, out = self._serve(device, ids.shape)
        return lookup.lookup(ids, out)

    @property
    def weight(self) -> torch.Tensor:
        """A meta tensor: the rows are on disk (:meth:`read_table` reads them)."""
        return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.compute_dtype, device="meta")

    @torch.no_grad()
    def load_weight_(self, weight: torch.Tensor) -> None:
        """Write ``weight [num_embeddings, embedding_dim]`` (any device) to :attr:`table_path` (quantised when
        ``backend_options["quantize"]`` says so) and serve that file."""
        if not self._checked_weight(weight):
            return
        if self.table_path is None:
            raise TypeError("this embedding's rows are a table file and it has no table_path to write a weight to: "
                            "build it with table_path=..., or attach a TableFile")
        if hasattr(self, "weight_scale"):
            raise TypeError("this embedding serves an fp8_global file (a checkpoint's codes and its weight_scale): "
                            "a weight is not written into it; load the checkpoint again")
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"a file embedding writes a bf16, fp16 or fp32 weight, got {weight.dtype}")
        q = self.backend_options.get("quantize")
        row_bytes = self.embedding_dim * weight.dtype.itemsize if q is None else _width("fp8_row", self.embedding_dim)
        check_options(self.backend_kind, self.backend_options, max_rows=self.max_tokens, row_bytes=row_bytes)
        rows = _tensor_rows(weight)
        if q is not None:
            from .quantize import fp8_row_source

            rows = fp8_row_source(rows, QUANTIZE[q])
        self._close_backends()
        file = table_file_for(self.table_path, rows, encoding="raw" if q is None else "fp8_row",
                              what=f"a {self.num_embeddings}x{self.embedding_dim} weight")
        try:
            self.attach_table(file, own=True)
        except BaseException:
            file.close()
            raise

    def read_table(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole table as a CPU tensor of values: a ``raw`` file's rows as stored, an encoded file's
        dequantised to ``dtype`` (default the output dtype; its entry's reference). Reads every page (checked
        against its sum)."""
        if self._table is None:
            raise RuntimeError("this file embedding has no table file yet")
        stored = self._table.read_rows(torch.arange(self.num_embeddings))
        if self._table.encoding == "raw":
            return stored
        scale = getattr(self, "weight_scale", None)
        return ENCODINGS[self._table.encoding].dequantise(stored, dtype or self.compute_dtype, scale)

    # ------------------------------------------------------------------ lookups
    def _served(self, options: dict, device: torch.device) -> tuple:
        file = self._table
        q = options.get("quantize")
        if q is not None and file.encoding != "fp8_row":
            raise ValueError(f"backend_options['quantize']={q!r} applies when a table file is written; {file.path} "
                             f"holds {file.encoding} rows: drop it, or write the file again quantised")
        for key in MODULE_OPTIONS:  # consumed when the file was written
            options.pop(key, None)
        if file.encoding == "raw":
            out_dtype = None if self.compute_dtype == file.dtype else self.compute_dtype
            return file, TableSpec.of(file, scale=self.scale_value, oob=self.oob, out_dtype=out_dtype)
        if file.encoding == "fp8_global":  # read on the device by every call
            options["dequant_scale"] = self.weight_scale.to(device=device, dtype=torch.float32)
        return file, TableSpec.of(file, oob=self.oob, out_dtype=self.compute_dtype)

    @property
    def quant_error(self):
        """None: a file's rows were quantised when it was written."""
        return None

    # ------------------------------------------------------------------ state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)  # a serving copy: no weight
        if not _excluded() and not self.__dict__.get("_said_state"):  # not the loaders' own use of it
            self._said_state = True
            log.warning("uvaple: %sweight is served from the table file %s and is not in the state dict: a model saved "
                        "now (save_pretrained) lacks it; save from the checkpoint the file was written from", prefix,
                        "(none yet)" if self._table is None else self._table.path)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight_scale"
        if hasattr(self, "weight_scale") and key in state_dict:
            self.weight_scale.copy_(state_dict[key].reshape(1))
            self._close_backends()  # a lookup holds the scale on its device
        elif hasattr(self, "weight_scale") and strict:
            missing_keys.append(key)
        key = prefix + "weight"
        if key in state_dict:  # a weight given is written to the file (a missing one is not: the file has the rows)
            try:
                self.load_weight_(state_dict[key])
            except (ValueError, TypeError) as e:
                error_msgs.append(f"{key}: {e}")
        if strict:
            known = (prefix + "weight", prefix + "weight_scale")
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known
                                   and "." not in k[len(prefix):])

    # ------------------------------------------------------------------ lifetime
    def __deepcopy__(self, memo):
        scale = getattr(self, "weight_scale", None)
        file = None if self._table is None else self._table.duplicate()  # these bytes, whatever is at the path now
        try:
            new = type(self)(self.num_embeddings, self.embedding_dim, file,
                             out_dtype=self.compute_dtype, embed_scale=self.scalar_embed_scale,
                             weight_scale=None if scale is None else scale.detach().cpu(), table_path=self.table_path,
                             backend=self.backend_kind, oob=self.oob, backend_options=dict(self.backend_options),
                             register=self.register_mode, max_tokens=self.max_tokens)
        except BaseException:
            if file is not None:
                file.close()
            raise
        memo[id(self)] = new
        new.training = self.training
        return new

    def extra_repr(self) -> str:
        if self._table is None:
            where = "table=no file yet" + ("" if self.table_path is None else f" ({self.table_path})")
        else:
            f = self._table
            where = f"table=file {f.path} ({f.encoding}, {fmt_bytes(f.layout.file_bytes)})"
        return (f"{self.num_embeddings}, {self.embedding_dim}, oob={self.oob}, backend={self.backend_kind}, {where}, "
                f"out_dtype={self.compute_dtype}")


def _file_placements() -> tuple[str, ...]:
    from .factory import PLACEMENTS

    return tuple(name for name, p in PLACEMENTS.items() if p.reads_file)
