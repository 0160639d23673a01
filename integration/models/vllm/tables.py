"""One rank's shard of a PLE table in host memory: opened at model construction, filled by vLLM's loader,
read by a uvaple lookup. No vLLM import here, so the sharing and filling logic is tested without vLLM.

Sharing (one host copy per node)
--------------------------------
vLLM shards a PLE table over a group of ranks (ETP for Qwen4Exp, TP for Gemma 3n): rank ``r`` of ``n``
holds rows ``[r * p, (r + 1) * p)`` of the padded vocabulary, ``p`` rows per rank. Each such shard is one
named segment, ``<base>.<layer>.r<r>of<n>``, opened with ``HostTable.shared(defer_ready=True)``: the
first process of the node to open it (rank ``r`` of some data-parallel replica, or of another server of
the same model) is its creator and fills it; every other process with the same shard attaches it
without a second copy. Together the shards are the table once per node, whatever the TP/DP layout.

Each process reads only its own shard, as vLLM's ranks do, and vLLM's sum over the group stays (a rank
contributes its rows and zeros elsewhere). The collective could be dropped if every rank read whole rows
from a whole-table segment, but every rank would then read all rows over its own PCIe link (the
bottleneck: ``n`` times the host bytes per step) and would have to wait for every other rank's fill
before its first read, a rendezvous across processes of the kind seed 003 describes. With one segment
per shard a process waits only for its own shard's creator, and only after its own loading is done.

Filling
-------
The table's CPU tensor is the parameter vLLM's loader writes (its names, ``weight_loader``, quantisation
method and scale parameters unchanged). The creator copies the rows it is given straight from the
checkpoint (a safetensors mmap) into the segment with several threads; an attacher's loader skips the
rows (the creator writes them) and checks only their shape. After loading (:meth:`ShardTable.finish`) the
creator checks that every row of its shard was written and marks the segment ready, or marks it failed
with the reason; an attacher waits, bounded by ``timeout_s``, for the creator's mark. A creator that dies
while filling releases its build lock: the waiters get a named error at once rather than a hang.

Quantised on load. With ``quantize: fp8_row`` a shard stores each row as fp8 e4m3 codes followed by its own
float32 scale (the ``fp8_row`` encoding: ``cols + 4`` bytes a row). The parameter vLLM's loader sees is the
codes' ``[rows, cols]`` view (so its shape checks hold); :meth:`ShardTable.write` quantises the checkpoint's
rows straight into the segment (:func:`~uvaple.integration.quantize.quantize_fp8_rows_into`, every core, no
copy of the block), and the lookup dequantises in the gather. With dummy weights (``load_format="dummy"``)
vLLM fills the codes with one value (the parameter's ``dummy_weight_value``: the fp16 temporary of the table's
size that vLLM makes for an fp8 parameter is not made), then :meth:`ShardTable.finish` writes every row as the
encoding of values drawn as vLLM draws a bf16 dummy table's (uniform in +-1e-3, seeded): a model of dummy
weights then computes on rows like the bf16 table's. (Rows of one value made the H200's dummy Qwen4Exp route
its tokens to fewer experts and decode 2x faster than with the bf16 table: not a figure of the encoding.)

Pages and registration. Nothing is pre-faulted at construction: each write commits the pages it writes
(so the allocation runs inside the fill, which reads the checkpoint anyway), :meth:`ShardTable.finish`
commits what was left and registers the mapping (an attacher: after the creator's mark). Construction
still registers one page of the segment and releases it, so a GPU that cannot read host memory is a
named error (or the copy fallback) before any loading, not after it.

Metrics
-------
Each shard's lookup is exported to vLLM's ``/metrics`` (:func:`export_metrics`, ``metrics_interval_s``).
vLLM serves that endpoint from its API server process; with ``PROMETHEUS_MULTIPROC_DIR`` set it
aggregates every process's ``prometheus_client`` files, so an engine process pushes its lookups'
``progress()`` there every few seconds (:class:`~uvaple.integration.telemetry.MultiprocessExporter`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading

import torch

from uvaple.integration.errors import BackendError
from uvaple.integration.factory import placement
from uvaple.integration.fork import ForkSafeLock
from uvaple.uva import HostTable
from uvaple.uva.errors import DeviceCapabilityError, RegistrationError

from .config import PluginConfig, PluginConfigError

#: the fp8 format of ``quantize: fp8_row`` shards (e4m3: vLLM's, and the finer of the two at these magnitudes)
FP8_ROW_FORMAT = torch.float8_e4m3fn
#: what vLLM's dummy loader writes into an ``fp8_row`` shard's codes before :meth:`ShardTable.finish` rewrites
#: the rows (any finite code: it is never read)
DUMMY_CODE = 0.5
#: vLLM's dummy range for 16-bit weights (``initialize_single_dummy_weight``: uniform in +-1e-3)
DUMMY_RANGE = 1e-3

__all__ = ["ShardTable", "PluginLoadError", "UvaUnavailable", "model_identity", "segment_name", "export_metrics"]

log = logging.getLogger("uvaple.vllm")


class PluginLoadError(BackendError, ValueError):
    """A checkpoint tensor does not fit the table, or the loader left rows of a shard unwritten."""


class UvaUnavailable(BackendError):
    """The uva placement cannot run here (the message says why); set ``fallback: copy`` or fix the cause."""


def model_identity(model: str, revision: str | None, dtype, quantization) -> str:
    """What a table's content depends on: the model (and, for a local directory, its weight files' sizes
    and modification times), revision, dtype and quantisation. Segments of another identity are not
    attached."""
    parts = [str(model), str(revision), str(dtype), str(quantization)]
    if os.path.isdir(model):
        for f in sorted(os.listdir(model)):
            if f.endswith((".safetensors", ".bin", ".pt")):
                st = os.stat(os.path.join(model, f))
                parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


_EXPORT_LOCK = ForkSafeLock()  # free in a forked child, whoever held it at the fork
_EXPORT: dict = {}  # this process's exporter (multiprocess) or collector (single process), made once


def export_metrics(name: str, lookup, interval_s: float) -> str | None:
    """Export ``lookup`` under ``lookup=name`` to the ``/metrics`` of the vLLM server this process is part
    of; returns how (``"multiprocess"``, ``"registry"``) or None when not exported.

    With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it when it runs several API servers; set it yourself,
    an empty directory, for one) one :class:`~uvaple.integration.telemetry.MultiprocessExporter` per process
    pushes every ``interval_s`` seconds into the files vLLM's API server aggregates. Without it, one
    collector in ``prometheus_client.REGISTRY`` reads at scrape time: served by vLLM only where the engine
    runs in the API server's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The first export says in the
    log which it is. Not exported with ``interval_s == 0`` or without ``prometheus_client``; a metrics
    failure is logged and never stops the model from being served."""
    if not interval_s:
        return None
    from uvaple.integration import telemetry

    with _EXPORT_LOCK:
        if _EXPORT.get("pid") != os.getpid():  # a forked child: its parent's objects restart themselves
            _EXPORT["pid"], _EXPORT["said"] = os.getpid(), False
        try:
            if telemetry.multiprocess_dir() is not None:
                if "multiprocess" not in _EXPORT:
                    _EXPORT["multiprocess"] = telemetry.MultiprocessExporter(interval_s)
                _EXPORT["multiprocess"].add(name, lookup)
                how = "multiprocess"
            else:
                if "registry" not in _EXPORT:
                    _EXPORT["registry"] = telemetry.register_prometheus({})
                _EXPORT["registry"].add(name, lookup)
                how = "registry"
        except Exception as e:  # noqa: BLE001 - metrics must never stop serving
            log.warning("uvaple: lookup %r not exported to /metrics: %s: %s", name, type(e).__name__, e)
            return None
        if not _EXPORT["said"]:
            _EXPORT["said"] = True
            if how == "multiprocess":
                log.info("uvaple: lookup metrics pushed every %g s into PROMETHEUS_MULTIPROC_DIR=%s (vLLM's "
                         "/metrics aggregates it)", interval_s, telemetry.multiprocess_dir())
            else:
                log.info("uvaple: lookup metrics in this process's prometheus_client registry; vLLM's /metrics "
                         "shows them only when the engine runs in the API server's process. To export them "
                         "from engine processes, start vLLM with PROMETHEUS_MULTIPROC_DIR set to an empty "
                         "directory")
        return how


def segment_name(base: str, layer: str, rank: int, size: int) -> str:
    """``<base>.<layer>.r<rank>of<size>`` within the segment name rules (1-200 of ``[A-Za-z0-9_.-]``)."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", layer)
    if tail != layer or len(tail) > 48:  # shortened or changed: the layer's own hash keeps names apart
        tail = tail[-40:].lstrip("._") + "-" + hashlib.sha256(layer.encode()).hexdigest()[:7]
    return f"{base}.{tail}.r{rank}of{size}"


class ShardTable:
    """Rank ``rank`` of ``size``'s shard of a PLE table: ``rows x cols`` of ``dtype`` in host memory.

    Parameters
    ----------
    cfg : PluginConfig
        Placement and sharing settings.
    layer : str
        The layer's prefix (names the segment).
    rows, cols, dtype :
        The shard's shape (vLLM's padded rows per rank) and storage dtype.
    loaded_rows : int
        Rows the checkpoint must fill (the rank's original-vocabulary rows; the rest is padding).
    rank, size : int
        The rank in the group that shards the table, and the group's size.
    identity : str
        :func:`model_identity`; segments of another identity are not attached.
    device : torch.device
        Where lookups run (a CUDA device, or the CPU where kernels run interpreted).
    check_loaded : bool
        Require every loaded row to have been written at :meth:`finish` (False for dummy weights).
    encoding : {"raw", "fp8_row"}
        ``"fp8_row"``: rows quantised on load (see Quantised on load); ``dtype`` is then the checkpoint's.
    cuda_graphs : bool
        The engine captures its forward in CUDA graphs: a ``copy`` fallback is refused (it cannot be captured).
    """

    def __init__(self, cfg: PluginConfig, *, layer: str, rows: int, cols: int, dtype: torch.dtype,
                 loaded_rows: int, rank: int, size: int, identity: str, device: torch.device,
                 check_loaded: bool = True, encoding: str = "raw", cuda_graphs: bool = False) -> None:
        if encoding not in ("raw", "fp8_row"):
            raise PluginConfigError(f"{layer}: a shard is stored raw or as fp8_row, not {encoding!r}")
        if encoding == "fp8_row" and (not dtype.is_floating_point or dtype.itemsize < 2):
            raise PluginConfigError(f"{layer}: quantize fp8_row takes a bf16/fp16/fp32 table; this one is {dtype} "
                                    "(an fp8 checkpoint is served as stored: set quantize 'none')")
        self.cfg = cfg
        self.layer = layer
        self.rank, self.size = rank, size
        self.loaded_rows = loaded_rows
        self.device = device
        self.check_loaded = check_loaded
        self.encoding = encoding
        self.cols, self.source_dtype = cols, dtype  # the values a row holds, as the checkpoint gives them
        self.quant_error = None  # fp8_row: the error report of the rows this process quantised (QuantError)
        if encoding == "fp8_row":
            from uvaple.kernels.encodings import ROW_SCALE_BYTES

            cols, dtype = cols + ROW_SCALE_BYTES, FP8_ROW_FORMAT
        self.placement = cfg.placement
        self.name = None
        self._lock = threading.Lock()
        self._written: list[tuple[int, int]] = []
        self._finished = False
        on_gpu = device.type == "cuda"
        # registration makes the doctor's checks (unified addressing, mapped host memory, the host pointer
        # usable by the GPU) and fails with a named error at once: never a hang, never a late fault
        register = on_gpu and placement(self.placement).mapped
        try:
            self.table = self._open(rows, cols, dtype, rank, size, identity, register)
        except (RegistrationError, DeviceCapabilityError) as e:
            fallback = None if cfg.fallback == "none" else placement(cfg.fallback)
            if fallback is not None and cuda_graphs and fallback.graph_refusal:
                raise UvaUnavailable(f"the {self.placement} placement cannot run on {device}: {e} (`uvaple doctor` "
                                     f"shows the checks), and its {fallback.name} fallback cannot run inside vLLM's "
                                     f"CUDA graphs: start with enforce_eager=True (--enforce-eager) to serve through "
                                     f"the {fallback.name} placement, or fix the cause") from e
            if fallback is None:
                raise UvaUnavailable(f"the {self.placement} placement cannot run on {device}: {e} (`uvaple doctor` "
                                     "shows the checks). Fix that, or start with --additional-config "
                                     '\'{"uvaple": {"fallback": "copy"}}\' to serve the table through the copy '
                                     "placement") from e
            log.warning("uvaple: %s; serving %s through the %s placement", e, layer, fallback.name)
            self.placement = fallback.name
            self.table = self._open(rows, cols, dtype, rank, size, identity, False)
        self.fills = self.table.created if self.name else True

    def _open(self, rows, cols, dtype, rank, size, identity, register) -> HostTable:
        if not self.cfg.shared:
            return HostTable.empty(rows, cols, dtype, register=register)
        base = self.cfg.segment or f"vllm-{identity[:16]}"
        self.name = segment_name(base, self.layer, rank, size)
        return HostTable.shared(self.name, rows, cols, dtype, defer_ready=True, timeout=self.cfg.timeout_s,
                                tag=f"{identity}:{self.layer}:{rank}/{size}", register=register,
                                directory=self.cfg.segment_dir)

    # ------------------------------------------------------------------ loading
    @property
    def tensor(self) -> torch.Tensor:
        """The CPU tensor over the shard: the parameter vLLM's loader writes (``[rows, cols]``; for ``fp8_row``
        the codes of each row, its scale left out)."""
        t = self.table.tensor
        return t[:, :self.cols] if self.encoding == "fp8_row" else t

    def write(self, rows: torch.Tensor, start: int) -> None:
        """Rows ``start .. start + len(rows)`` of the shard, from a checkpoint tensor (any device, cast to the
        table's dtype as vLLM's ``copy_`` does). An attacher checks the shape only: the creator writes."""
        rows = rows.detach()
        if rows.dim() != 2 or rows.shape[1] != self.cols or not 0 <= start <= self.table.rows - rows.shape[0]:
            raise PluginLoadError(f"{self.layer}: checkpoint rows of shape {tuple(rows.shape)} at row {start} do "
                                  f"not fit the shard of {self.table.rows} x {self.cols}")
        if self.fills and self.encoding == "fp8_row":
            self._quantise(rows, start)
        elif self.fills:
            self.table.write_rows(rows if rows.dtype == self.table.dtype else rows.to(self.table.dtype), start)
        with self._lock:
            self._written.append((start, rows.shape[0]))

    def _quantise(self, rows: torch.Tensor, start: int) -> None:
        """``rows`` as fp8_row codes and scales into rows ``start ..`` of the shard (see Quantised on load)."""
        from uvaple.integration.quantize import quantize_fp8_rows_into

        if not rows.dtype.is_floating_point or rows.dtype.itemsize < 2:
            raise PluginLoadError(f"{self.layer}: quantize fp8_row takes bf16/fp16/fp32 checkpoint rows, got "
                                  f"{rows.dtype}; an fp8 checkpoint is served as stored (quantize 'none')")
        try:
            err = quantize_fp8_rows_into(rows, self.table.writable_bytes(start, rows.shape[0]), FP8_ROW_FORMAT,
                                         out_dtype=self.source_dtype, slice_cols=self.cols, row_start=start)
        except ValueError as e:  # a row holding inf or NaN: no fp8 scale represents it
            raise PluginLoadError(f"{self.layer}: {e}") from None
        with self._lock:  # one report over every write
            self.quant_error = err if self.quant_error is None else self.quant_error.combined(err)

    def missing_rows(self) -> int:
        """Rows of ``[0, loaded_rows)`` no write has covered yet."""
        covered, end = 0, 0
        for s, n in sorted(self._written):
            s, e = max(s, end), min(s + n, self.loaded_rows)
            if e > s:
                covered += e - s
                end = e
        return self.loaded_rows - covered

    def finish(self) -> None:
        """After loading: the creator checks every row was written and marks the segment ready (or failed);
        an attacher waits, bounded, for that mark. Idempotent."""
        if self._finished:
            return
        missing = self.missing_rows() if self.check_loaded else 0
        err = PluginLoadError(f"{self.layer}: the checkpoint left {missing} of {self.loaded_rows} rows of this "
                              "shard unwritten; check that it holds the whole table") if missing else None
        if self.fills and self.encoding == "fp8_row" and not self.check_loaded and err is None:
            self._dummy_rows()
        if self.fills and self.name:
            if err is not None:
                self.table.mark_failed(err)  # processes waiting for this shard get the same error
                raise err
            self.table.mark_ready()
        elif err is not None:
            raise err
        else:
            self.table.wait_ready(self.cfg.timeout_s)
        if self.quant_error is not None:
            q = self.quant_error.summary()
            log.info("uvaple: %s quantised to fp8_row on load: %d rows, largest error %.4g (%.3g of its slice's "
                     "largest magnitude)", self.layer, q["rows"], q["max_abs"], q["max_rel"])
        self._finished = True

    def _dummy_rows(self, seed: int = 1234) -> None:
        """Dummy weights: every row the fp8_row encoding of values uniform in +-:data:`DUMMY_RANGE` (see Quantised
        on load), drawn in blocks of rows, each block from its own seeded generator, on every core."""
        from uvaple.integration.quantize import quantize_fp8_rows_into
        from uvaple.uva.workers import chunks, default_threads, parallel

        def fill(a: int, n: int) -> None:
            g = torch.Generator().manual_seed(seed + a)
            x = torch.empty(n, self.cols, dtype=self.source_dtype).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=g)
            quantize_fp8_rows_into(x, self.table.writable_bytes(a, n), FP8_ROW_FORMAT, out_dtype=self.source_dtype,
                                   slice_cols=self.cols, row_start=a, threads=1)

        parallel(fill, chunks(self.table.rows, 1 << 16), default_threads(), name="uvaple-dummy-rows")

    @property
    def finished(self) -> bool:
        return self._finished

    def lookup(self, spec, *, dequant_scale: torch.Tensor | None = None, max_rows: int | None = None,
               id_start: int = 0, token_ids: bool = True):
        """The lookup of this shard in the configured placement (``copy`` needs ``max_rows``), with the
        configured ``dedup`` and hot set (``hot_cache_gb``/``hot_profile``: the profile's ids from ``id_start``,
        the global id of the shard's row 0, count for this shard). ``token_ids``: the table is read by token
        ids (a hot set ranked on a tokenised text means nothing for hashed n-gram ids: refused)."""
        from uvaple.integration import make_lookup

        if self.cfg.hot_cache_gb and not token_ids:
            raise PluginConfigError(f"hot_cache_gb: {self.layer} is read by hashed n-gram ids, which a profile of "
                                    "token ids cannot rank; the hot set serves token-id tables (Gemma 3n)")
        served = placement(self.placement)
        if not served.gather_options:
            if self.cfg.dedup or self.cfg.hot_cache_gb:
                log.warning("uvaple: %s is served through the %s placement: dedup and the hot set are not used",
                            self.layer, self.placement)
            options = {}
        else:
            # max_rows sizes the sorted gather's workspace: big prefill calls of small rows are read in id order,
            # and with dedup prefill-sized calls of any rows read each distinct id once
            hot = self._hot_set(id_start) if self.cfg.hot_cache_gb and served.hot_set else None
            options = dict(dequant_scale=dequant_scale, dedup=self.cfg.dedup and max_rows is not None, hot=hot)
        lk = make_lookup(self.placement, self.table, device=self.device, spec=spec, max_rows=max_rows, **options)
        name = f"{self.layer}[{self.rank}/{self.size}]"
        log.info("uvaple: %s served by the %s placement from %s (%s)", name, self.placement,
                 "a shared host table" if self.table.name else "a private host table", self.table.name or "unnamed")
        export_metrics(name, lk, self.cfg.metrics_interval_s)
        return lk

    def _hot_set(self, id_start: int):
        """The shard's hot set: ``hot_cache_gb`` of HBM holding its rows most frequent in ``hot_profile``."""
        from uvaple.integration import HotSet, counts_of_ids, rank_rows

        try:
            capacity = HotSet.capacity_for(self.table, cache_gb=self.cfg.hot_cache_gb)
        except ValueError as e:
            raise PluginConfigError(f"hot_cache_gb={self.cfg.hot_cache_gb}: {e}") from None
        try:
            counts = counts_of_ids(self.cfg.hot_profile, self.loaded_rows, start=id_start)
        except (OSError, ValueError) as e:
            raise PluginConfigError(f"hot_profile {self.cfg.hot_profile!r} is not a .npy file or a text file of "
                                    f"integer token ids: {e}") from None
        rows = rank_rows(counts, capacity)
        log.info("uvaple: %s holds %d of its %d rows in HBM (%d slots, hot_cache_gb=%s)", self.layer, rows.numel(),
                 self.table.rows, capacity, self.cfg.hot_cache_gb)
        return HotSet(self.table, capacity, self.device, rows=rows)

    def close(self) -> None:
        self.table.close()
