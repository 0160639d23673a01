"""Table readiness: seconds and GiB/s to make a table usable, ours against pinned torch memory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import GIB, MIB, ROW_BYTES, ST_WRITE_LIMIT_S, BenchConfig, error_text, fmt_gib
from .progress import Progress
from .providers import host_budget


# -------------------------------------------------------------------------------------------- readiness
def release_pinned() -> bool:
    """Return torch's cached pinned host blocks to the OS (the name moved between torch releases)."""
    candidates = (
        getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
        getattr(torch._C, "_host_emptyCache", None),
        getattr(torch._C, "_accelerator_emptyHostCache", None),
    )
    for fn in candidates:
        if fn is None:
            continue
        try:
            fn()
            return True
        except Exception:  # noqa: BLE001 - try the next spelling
            continue
    return False


def _write_safetensors(path: Path, name: str, rows: int, cols: int, dtype: torch.dtype,
                       seed: int, deadline_s: float) -> None:
    """Write a ``[rows, cols]`` tensor of random values (a repeated 64-MiB random block) to ``path``."""
    from uvaple.uva import SUPPORTED_DTYPES

    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = rows * cols * itemsize
    header = {name: {"dtype": SUPPORTED_DTYPES[dtype], "shape": [rows, cols], "data_offsets": [0, nbytes]},
              "__metadata__": {"format": "pt", "written_by": "uvaple.perf.bench"}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    gen = torch.Generator().manual_seed(seed)
    block_elems = max(1, min(nbytes, 64 * MIB) // itemsize)
    block = torch.randn(block_elems, generator=gen).to(dtype).view(torch.uint8).numpy().tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        left = nbytes
        while left > 0:
            chunk = block[: min(left, len(block))]
            f.write(chunk)
            left -= len(chunk)
            if time.perf_counter() - t0 > deadline_s:
                raise TimeoutError(f"writing the {nbytes / GIB:.1f} GiB file took over {deadline_s:.0f} s")


def _safetensors_source(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
    return 8 + hlen, path.stat().st_size - 8 - hlen


def _pick_tmp_dir(cfg: BenchConfig, nbytes: int) -> Path | None:
    candidates = [cfg.tmp_dir] if cfg.tmp_dir else ["/dev/shm", tempfile.gettempdir()]
    for d in candidates:
        try:
            if d and os.path.isdir(d) and shutil.disk_usage(d).free > nbytes * 1.1 + 2 * GIB:
                return Path(d)
        except OSError:
            continue
    return None


def _readiness_row(meta: dict[str, Any], **kw: Any) -> dict[str, Any]:
    row = {"kind": "readiness", "method": "", "table_gib": 0.0, "bytes": 0, "seconds": None,
           "gib_per_s": None, "check": "", "error": "", "note": ""}
    row.update(kw)
    row.update({f"meta_{k}": v for k, v in meta.items()})
    return row


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def run_readiness(cfg: BenchConfig, meta: dict[str, Any], progress: Progress, *, deadline: float = math.inf,
                  checkpoint: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Time making a table usable, per size: HostTable vs ``torch.empty(pin_memory=True)`` (+ copy).

    Sizes not started by ``deadline`` (a ``perf_counter`` value) are reported as skipped.
    """
    from uvaple.uva import HostTable

    rows_out: list[dict[str, Any]] = []
    row_bytes = ROW_BYTES["e4b"] if ROW_BYTES["e4b"] in cfg.row_bytes or not cfg.row_bytes else cfg.row_bytes[0]
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    cols = row_bytes // itemsize
    pin = cfg.cuda
    torch_label = "torch.empty(pin_memory=True)" if pin else "torch.empty (no CUDA: unpinned)"
    budget = host_budget(cfg)
    for gib in cfg.readiness_gib:
        rows = max(1, int(gib * GIB) // row_bytes)
        nbytes = rows * row_bytes
        torch_bytes = 1 << (nbytes - 1).bit_length() if pin else nbytes  # torch pins power-of-two blocks
        where = f"readiness {fmt_gib(gib)}"
        if checkpoint is not None and rows_out:
            checkpoint(rows_out)
        # Start a size only if its estimate ends by the deadline (+30 s of slack on a 480-s outer timeout).
        if time.perf_counter() + _readiness_size_estimate_s(cfg, gib) > deadline + 30.0:
            for m in ("HostTable.empty", torch_label, "HostTable.from_safetensors", f"{torch_label} + copy_ from mmap"):
                rows_out.append(_readiness_row(meta, method=m, table_gib=gib, bytes=nbytes, check="skipped",
                                               error="skipped: time budget spent (--time-budget)"))
            for _ in range(3):
                progress.step(f"{where} (skipped: time budget)")
            continue

        def add(method: str, seconds: float | None, *, check: str = "ok", error: str = "", note: str = "",
                nb: int = nbytes, _gib: float = gib) -> None:
            rows_out.append(_readiness_row(
                meta, method=method, table_gib=_gib, bytes=nb, seconds=seconds,
                gib_per_s=(nb / GIB / seconds) if seconds else None, check=check, error=error, note=note))

        # HostTable.empty: create + prefault + register
        progress.step(f"{where}: HostTable.empty")
        if nbytes + 4 * GIB > budget and cfg.cuda:
            add("HostTable.empty", None, check="skipped", error=f"needs {nbytes / GIB:.1f} GiB; host has "
                f"{budget / GIB:.1f} GiB (--host-mem-gib)")
        else:
            try:
                secs, table = _timed(lambda r=rows: HostTable.empty(
                    r, cols, cfg.dtype, check_memory=cfg.host_mem_gib is None))
                reg = bool(table.registered)
                table.close()
                add("HostTable.empty", secs, check="ok" if (reg or not cfg.cuda) else "unregistered")
            except Exception as e:  # noqa: BLE001
                add("HostTable.empty", None, check="error", error=error_text(e))

        # torch.empty(pin_memory=True): what vLLM does
        progress.step(f"{where}: {torch_label}")
        if torch_bytes + 4 * GIB > budget and cfg.cuda:
            add(torch_label, None, check="skipped", nb=torch_bytes,
                error=f"torch pins a {torch_bytes / GIB:.0f} GiB block; host has {budget / GIB:.1f} GiB")
        else:
            try:
                # An empty pinned cache, or torch would hand back a cached block in no time.
                cache_note = "" if (release_pinned() or not pin) else "torch's pinned cache could not be emptied; "
                secs, buf = _timed(lambda nb=nbytes: torch.empty(nb, dtype=torch.uint8, pin_memory=pin))
                del buf
                release_pinned()
                add(torch_label, secs, note=cache_note + ("" if torch_bytes == nbytes else
                    f"torch pins a {torch_bytes / GIB:.2f} GiB block for {nbytes / GIB:.2f} GiB"))
            except Exception as e:  # noqa: BLE001
                add(torch_label, None, check="error", error=error_text(e))

        # from a safetensors file in page cache
        progress.step(f"{where}: from_safetensors")
        st_methods = ("HostTable.from_safetensors", f"{torch_label} + copy_ from mmap")
        if gib > cfg.safetensors_max_gib + 1e-9:
            for m in st_methods:
                add(m, None, check="skipped",
                    error=f"over --safetensors-max-gib {cfg.safetensors_max_gib:g} (file + table + page cache)")
            continue
        if cfg.cuda and nbytes + max(nbytes, torch_bytes) + 8 * GIB > budget:
            for m in st_methods:
                add(m, None, check="skipped", error="file in page cache + table would not fit in host memory")
            continue
        tmp = _pick_tmp_dir(cfg, nbytes)
        if tmp is None:
            for m in st_methods:
                add(m, None, check="skipped", error="no temporary directory with room for the file")
            continue
        path = tmp / f"uvaple_bench_{os.getpid()}_{rows}x{cols}.safetensors"
        try:
            _readiness_safetensors(path, rows, cols, cfg, pin, st_methods, add)
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
    return rows_out


def _readiness_safetensors(path: Path, rows: int, cols: int, cfg: BenchConfig, pin: bool,
                           methods: tuple[str, str], add: Callable[..., None]) -> None:
    import numpy as np

    from uvaple.uva import HostTable

    try:
        _write_safetensors(path, "table", rows, cols, cfg.dtype, cfg.seed, ST_WRITE_LIMIT_S)
        offset, nbytes = _safetensors_source(path)
        # The file was just written, so its pages are in the page cache (tmpfs or dirty/clean disk pages).
        mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
    except Exception as e:  # noqa: BLE001
        for m in methods:
            add(m, None, check="skipped", error=f"could not write the file: {error_text(e)}")
        return
    probe = sorted({0, rows // 2, rows - 1})
    row_bytes = nbytes // rows
    expect = {r: bytes(mm[r * row_bytes:(r + 1) * row_bytes]) for r in probe}

    try:
        secs, table = _timed(lambda: HostTable.from_safetensors(
            path, "table", check_memory=cfg.host_mem_gib is None))
        try:
            view = table.bytes_view()  # [rows, stride_bytes] uint8
            ok = all(view[r, :row_bytes].tobytes() == expect[r] for r in probe)
        finally:
            table.close()
        add(methods[0], secs, check="ok" if ok else "MISMATCH",
            error="" if ok else "loaded rows differ from the file")
    except Exception as e:  # noqa: BLE001
        add(methods[0], None, check="error", error=error_text(e))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only memmap: torch warns about non-writable arrays
            src = torch.from_numpy(mm)

        release_pinned()

        def load() -> torch.Tensor:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            buf.copy_(src)
            return buf

        secs, buf = _timed(load)
        ok = all(buf[r * row_bytes:(r + 1) * row_bytes].numpy().tobytes() == expect[r] for r in probe)
        del buf
        release_pinned()
        add(methods[1], secs, check="ok" if ok else "MISMATCH", error="" if ok else "copied rows differ")
    except Exception as e:  # noqa: BLE001
        add(methods[1], None, check="error", error=error_text(e))
    del mm

def readiness_estimate_s(cfg: BenchConfig) -> float:
    """Seconds the readiness part should take (kept in reserve by the gather sweep's time budget).

    Per GiB: ~0.1 s HostTable.empty (32 GiB prefault + register in 2.1 s on the H200), ~0.6 s
    torch.empty(pin_memory=True) (single-threaded fault + pin: 100 GiB in 44-78 s), and where a file is
    written ~1.2 s more (write, HostTable load, pinned alloc + copy).
    """
    return sum(_readiness_size_estimate_s(cfg, g) for g in cfg.readiness_gib)


def _readiness_size_estimate_s(cfg: BenchConfig, gib: float) -> float:
    if not cfg.cuda:
        return 0.0
    return 0.7 * gib + (1.2 * gib if gib <= cfg.safetensors_max_gib else 0.0)
