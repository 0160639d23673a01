"""The plugin's ``disk`` placement: a rank's PLE shard served from a table file on local disk.

For tables larger than the host memory a server can give them. vLLM's loader (or its dummy fill) writes the
shard as it writes any other (:class:`~uvaple.integration.models.vllm.tables.ShardTable`'s ``write``, its checks,
the ``fp8_row`` quantiser); here the rows it writes land in a **staging file**, a sparse file of the shard's size
on the disk of the table files, mapped shared: the kernel writes its pages back, so no host memory of the
table's size is held. After loading, the table file (:mod:`uvaple.uva.table_file`: the project's row layout, a
checksum a page) is written from the staging file, the staging file's blocks are given back to the filesystem
(``MADV_REMOVE``: vLLM's parameter still maps it and reads zeros), and the lookup is a
:class:`~uvaple.integration.placements.disk.DiskLookup`: a row cache of ``disk_cache_gb`` of pinned host memory
in front of the file, each call planned and read on the host, in vLLM's eager mode only (CUDA graphs cannot hold
a call: refused at start-up by :func:`~uvaple.integration.models.vllm.config.check_engine`).

Files, by the model's identity. A shard's table file is ``<disk_dir>/<base>.<layer>.r<rank>of<size>.uvt`` (the
segment names' rules, :func:`~uvaple.integration.models.vllm.tables.segment_name`), its header naming what it was
written from (the model's identity, the layer, the rank, the encoding). A later engine of the same checkpoint
finds the file complete and reuses it: its loader's rows are checked, not written, and nothing is staged. Dummy
weights are never reused (written at each start). Processes writing the same file (data-parallel replicas) write
one at a time (a lock on the folder), the later ones reusing the first's. Files of another identity (the weights
changed) are written beside the old ones: ``uvaple table prune DISK_DIR --unused-days N`` removes those no engine
has reused for ``N`` days and none holds open (a reuse stamps the file's modification time).

Disk space: the staging file's blocks are taken when it is made (a disk too full is a named error then, never a
fault as the loader writes), and the staging file and the table file both exist while the file is written (about
twice the shard); then the staging file's blocks go. A reused file stages nothing. A staging file left by a
killed process between its making and the removal of its name (``<file>.loading.<pid>``) is removed by the next
start of the same shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import shutil

import numpy as np
import torch

from uvaple.dtypes import fmt_bytes
from uvaple.uva import HostMemoryError, RowSource, TableFileError, row_stride_bytes
from uvaple.uva.table_file import remove_dead_partials
from uvaple.uva.workers import chunks, default_threads, parallel

from .config import DEFAULT_DISK_CACHE_GB, PluginConfigError
from .tables import PluginLoadError, ShardTable, export_metrics, segment_name

__all__ = ["DiskShard", "StagingFile"]

log = logging.getLogger("uvaple.vllm")

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class StagingFile:
    """``rows x cols`` of ``dtype`` in a sparse file at ``path``, mapped shared; the name is removed at once (the
    mapping holds the file). The part of a host table's interface a :class:`ShardTable` writes through."""

    name = None  # no shared segment: the table file is what processes share
    created = True

    def __init__(self, path: str, rows: int, cols: int, dtype: torch.dtype, *, reserve: bool = True) -> None:
        self.rows, self.cols, self.dtype = rows, cols, dtype
        self.row_bytes = cols * dtype.itemsize
        nbytes = rows * self.row_bytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TableFileError(f"cannot create the staging file {path}: {e.strerror or e}") from None
        self._fd, self._folder = fd, os.path.dirname(path)  # kept open: reserve() may take the blocks later
        try:
            os.ftruncate(fd, nbytes)
            if reserve:  # its blocks taken now: a full disk is this named error, never a SIGBUS as the loader writes
                self._reserve(nbytes)
            self._map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:  # (ValueError: an empty shard, which no table has)
            os.close(fd)
            raise TableFileError(f"cannot map the staging file {path} ({nbytes} bytes): {e.strerror or e}") from None
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8).view(dtype).view(rows, cols)
        self.shape = (rows, cols)
        self.released = False

    def reserve(self) -> None:
        """Take the file's blocks now (a shard that was to be reused is staged after all)."""
        self._reserve(len(self._map))

    def _reserve(self, nbytes: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                log.warning("uvaple: %s cannot reserve blocks (%s): the staging file is sparse, and a disk that fills "
                            "up as the loader writes ends the process", self._folder, e)
                return
            raise TableFileError(f"the staging file of {fmt_bytes(nbytes)} does not fit in {self._folder} "
                                 f"({e.strerror or e}): free about twice that (the table file is written from it), or "
                                 "give another disk_dir") from None

    def write_rows(self, src: torch.Tensor, row_start: int = 0) -> None:
        """Rows ``row_start ..`` from ``src`` (cast to the table's dtype), in blocks on several threads."""
        dst = self.tensor[row_start:row_start + src.shape[0]]
        block = max(1, (64 << 20) // max(1, self.row_bytes))

        def copy(a: int, n: int) -> None:
            dst[a:a + n].copy_(src[a:a + n])

        parallel(copy, chunks(src.shape[0], block), default_threads(), name="uvaple-staging")

    def writable_bytes(self, row_start: int, n: int) -> np.ndarray:
        """numpy ``uint8`` ``[n, row_bytes]`` over rows ``row_start .. row_start + n`` (a quantiser writes them)."""
        if not 0 <= row_start <= row_start + n <= self.rows:
            raise ValueError(f"rows {row_start}..{row_start + n} do not fit a table of {self.rows} rows")
        return np.frombuffer(self._map, dtype=np.uint8).reshape(self.rows, self.row_bytes)[row_start:row_start + n]

    def wait_ready(self, timeout: float | None = None) -> None:
        """Private: always ready."""

    def release(self) -> None:
        """Give the file's blocks (and their page cache) back; the mapping stays valid and reads zeros. Idempotent;
        where the filesystem cannot punch holes they stay until the process ends (logged)."""
        if self.released:
            return
        self.released = True
        try:
            self._map.madvise(mmap.MADV_REMOVE)
        except (OSError, AttributeError, ValueError) as e:
            log.warning("uvaple: the staging file's %d bytes stay on disk until this process ends (%s)",
                        len(self._map), e)

    def close(self) -> None:
        self.release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DiskShard(ShardTable):
    """A :class:`ShardTable` whose rows are served from a table file on local disk (see the module docstring).
    Takes ShardTable's parameters; the settings ``disk_dir`` and ``disk_cache_gb`` place the file and size its
    row cache."""

    def __init__(self, cfg, **kw) -> None:
        self.file = None
        super().__init__(cfg, **kw)
        if self.file is not None:  # written by an earlier engine of the same checkpoint: the loader's rows unused
            self.fills = False
            log.info("uvaple: %s[%d/%d] <- %s (written before, from the same checkpoint)", self.layer, self.rank,
                     self.size, self.path)

    def _open(self, rows, cols, dtype, rank, size, identity, register):
        """The table file written before from the same checkpoint, if any (``self.file``), and the staging file
        (``register`` unused: the row cache is registered when the lookup is built)."""
        from uvaple.integration.file_embedding import make_folder, reusable

        folder = self.cfg.disk_dir
        try:
            make_folder(folder)
        except TableFileError as e:
            raise PluginConfigError(f"disk_dir: {e}") from None
        if register:
            _check_mapping(self.device, self.layer)
        base = self.cfg.segment or f"vllm-{identity[:16]}"
        # dummy weights (never reused) have files of their own: a dummy engine leaves a real one's file alone
        kind = "" if self.check_loaded else ".dummy"
        self.path = os.path.join(folder, segment_name(base, self.layer, rank, size) + kind + ".uvt")
        # how the file stores the rows: quantised on load, an fp8 checkpoint's codes (one global scale), or as given
        self.file_encoding = "fp8_row" if self.encoding == "fp8_row" else "fp8_global" if dtype in _FP8 else "raw"
        self.source_id = f"vllm {identity} {self.layer} {rank}/{size} {self.file_encoding}" if self.check_loaded \
            else None
        self.file = reusable(self.path, RowSource(rows, cols, dtype, None), self.file_encoding, self.source_id)
        remove_dead_partials(self.path, kind="loading")
        try:
            if self.file is None:
                self._check_space(folder, rows, cols, dtype)
            return StagingFile(f"{self.path}.loading.{os.getpid()}", rows, cols, dtype, reserve=self.file is None)
        except TableFileError as e:
            if self.file is not None:
                self.file.close()
            raise PluginLoadError(f"{self.layer}: {e}") from None

    def _check_space(self, folder: str, rows: int, cols: int, dtype: torch.dtype) -> None:
        """A TableFileError where ``folder``'s disk cannot hold the staging file and the table file at once."""
        from uvaple.uva.table_file import FileLayout

        need = rows * cols * dtype.itemsize + FileLayout.of(rows, cols, dtype, self.file_encoding).file_bytes
        free = shutil.disk_usage(folder).free
        if free < need:
            raise TableFileError(f"{folder} has {fmt_bytes(free)} free; the staging file and the table file of this "
                                 f"shard take {fmt_bytes(need)} while the engine starts (the staging file's go after): "
                                 "free that much, or give another disk_dir")

    def write(self, rows: torch.Tensor, start: int) -> None:
        """As :meth:`ShardTable.write`; where the table file is reused, the block's first row is compared with the
        file's, so that a file of other weights under the same identity (a hub model without a revision whose
        weights changed) is not served: at the first block the shard stages the checkpoint after all, later it
        is a named error (the file is removed; the next start writes it)."""
        if not self.fills and rows.dim() == 2 and rows.shape[0] and 0 <= start < self.table.rows \
                and rows.shape[1] == self.cols and not self._same_as_file(rows[:1], start):
            if not self._written:
                log.warning("uvaple: %s holds other rows than this checkpoint's %s: writing it again", self.path,
                            self.layer)
                self.file.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # (its source names this checkpoint: it would be found again)
                self.file, self.fills = None, True
                self._check_space(os.path.dirname(self.path), self.table.rows, self.table.cols, self.table.dtype)
                self.table.reserve()
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                raise PluginLoadError(f"{self.layer}: the table file {self.path} holds rows other than this "
                                      f"checkpoint's at row {start}, though it was written from a checkpoint of the "
                                      "same name, revision and dtype (name a revision to tell them apart); it is "
                                      "removed: start the engine again to write it from this checkpoint")
        super().write(rows, start)

    def _same_as_file(self, row: torch.Tensor, start: int) -> bool:
        """Whether checkpoint ``row`` (one, at shard row ``start``) stored as this shard stores it is the file's."""
        stored = np.zeros((1, self.table.row_bytes), dtype=np.uint8)
        if self.encoding == "fp8_row":
            from uvaple.integration.quantize import quantize_fp8_rows_into

            from .tables import FP8_ROW_FORMAT

            try:
                quantize_fp8_rows_into(row, stored, FP8_ROW_FORMAT, out_dtype=self.source_dtype,
                                       slice_cols=self.cols, threads=1)
            except ValueError:  # a row no fp8 scale holds: ShardTable.write names it
                return True
        else:
            cast = row.detach().to("cpu", self.table.dtype).contiguous()
            stored[0] = cast.view(torch.uint8).reshape(-1).numpy()
        in_file = self.file.read_rows(torch.tensor([start])).contiguous().view(torch.uint8).reshape(-1)
        return bool(np.array_equal(in_file.numpy()[:self.table.row_bytes], stored[0]))

    def finish(self) -> None:
        """After loading: every row written (real weights), dummy fp8_row rows drawn, as a host shard does; the
        table file is written by :meth:`lookup`, once the lookup's encoding is known. Idempotent."""
        if self.finished:
            return
        if self.fills:
            super().finish()
        else:  # the file holds the rows: only the loader's coverage is checked
            missing = self.missing_rows() if self.check_loaded else 0
            if missing:
                raise PluginLoadError(f"{self.layer}: the checkpoint left {missing} of {self.loaded_rows} rows of this "
                                      "shard unwritten; check that it holds the whole table")
            self._finished = True

    def lookup(self, spec, *, dequant_scale: torch.Tensor | None = None, max_rows: int | None = None,
               id_start: int = 0, token_ids: bool = True):
        """The disk lookup of this shard's table file (written here from the staging file unless reused), with a
        row cache of ``disk_cache_gb``; ``spec`` as for a host shard (its encoding must be the file's)."""
        from uvaple.integration import make_lookup
        from uvaple.integration.file_embedding import table_file_for
        from uvaple.integration.placements.disk import DiskLookup

        if spec.encoding != self.file_encoding:
            raise PluginLoadError(f"{self.layer}: the lookup reads {spec.encoding} rows; the table file holds "
                                  f"{self.file_encoding}")
        if max_rows is None:
            raise PluginConfigError(f"{self.layer}: the disk placement needs the most ids a call brings")
        if self.cfg.dedup:
            log.warning("uvaple: %s is served through the disk placement: dedup is not used", self.layer)
        gb = self.cfg.disk_cache_gb or DEFAULT_DISK_CACHE_GB
        budget = int(gb * 1e9)
        try:
            DiskLookup.check_options({"budget_bytes": budget}, max_rows=max_rows,
                                     row_bytes=self.table.row_bytes)
        except ValueError:
            need = max_rows * row_stride_bytes(self.table.row_bytes) / 1e9
            raise PluginConfigError(f"disk_cache_gb={gb:g} for {self.layer}: a step of vLLM's may bring {max_rows} "
                                    f"distinct rows of {self.table.row_bytes} B, which the row cache must hold at "
                                    f"once: give disk_cache_gb >= {need:.3g}") from None
        name = f"{self.layer}[{self.rank}/{self.size}]"
        if self.file is None:
            try:
                self.file = table_file_for(self.path, RowSource.of(self.table.tensor), encoding=self.file_encoding,
                                           source_id=self.source_id, what=name)
            except TableFileError as e:
                raise PluginLoadError(f"{name}: writing its table file failed: {e}") from None
        self.table.release()  # its rows are in the file
        spec = dataclasses.replace(spec, stride=self.file.stride)
        try:
            lk = make_lookup("disk", self.file, device=self.device, spec=spec, max_rows=max_rows,
                             budget_bytes=budget, dequant_scale=dequant_scale)
        except HostMemoryError as e:
            raise PluginConfigError(f"disk_cache_gb={gb:g} for {name}: its row cache does not fit in pinned host "
                                    f"memory ({e}); give a smaller disk_cache_gb") from None
        log.info("uvaple: %s served by the disk placement from %s (row cache %s GB)", name, self.path, f"{gb:g}")
        export_metrics(name, lk, self.cfg.metrics_interval_s)
        return lk

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.table.close()


def _check_mapping(device: torch.device, layer: str) -> None:
    """A named error now, before loading, where the GPU cannot map pinned host memory (the row cache is
    registered only when the lookup is built, after the table file is written)."""
    from uvaple.uva import HostTable
    from uvaple.uva.errors import DeviceCapabilityError, RegistrationError

    from .tables import UvaUnavailable

    try:
        HostTable.empty(1, 4096, torch.uint8, register=True, device=device.index).close()
    except (RegistrationError, DeviceCapabilityError) as e:
        raise UvaUnavailable(f"{layer}: the disk placement's row cache is pinned host memory the GPU maps, and "
                             f"{device} cannot map it: {e} (`uvaple doctor` shows the checks); use the copy "
                             "placement with enforce_eager, or fix the cause") from e
