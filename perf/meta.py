"""Machine and software facts every benchmark result row carries."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from uvaple.machine import gpu_info

from .config import GIB, BenchConfig


# --------------------------------------------------------------------------------------------- metadata
def _run(cmd: Sequence[str], cwd: str | None = None, timeout: float = 10.0) -> str | None:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None

def _git_commit() -> tuple[str, bool | None]:
    here = str(Path(__file__).resolve().parent)
    commit = _run(["git", "rev-parse", "HEAD"], cwd=here)
    if not commit:
        return "unknown", None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here)
    return commit, bool(dirty) if dirty is not None else None


def host_mem_total() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")




def collect_meta(cfg: BenchConfig) -> dict[str, Any]:
    """Machine and software facts every result row carries."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "unavailable"
    commit, dirty = _git_commit()
    meta: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "mode": "gpu" if cfg.cuda else "cpu-interpreter",
        "preset": cfg.preset,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_runtime": torch.version.cuda or "none",
        "git_commit": commit,
        "git_dirty": dirty,
        "cpu_count": os.cpu_count(),
        "host_mem_gib": round(host_mem_total() / GIB, 1),
        "gpu_name": "none (CPU, Triton interpreter)",
        "driver": "none",
        "pcie_link": "none",
    }
    if cfg.cuda:
        index = torch.cuda.current_device()
        info = gpu_info(index)
        if info is None:
            info = {"gpu_name": torch.cuda.get_device_name(index), "driver": "unknown", "pcie_link": "unknown"}
        meta.update(info)
    return meta
