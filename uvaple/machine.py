"""Facts about the GPU for reports: name, driver and PCIe link, from NVML or ``nvidia-smi``."""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

__all__ = ["gpu_info"]


def _nvml(index: int) -> dict[str, Any] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML missing or unusable: fall back to nvidia-smi
        return None
    try:
        handle = None
        try:  # match torch's device by PCI bus id (CUDA_VISIBLE_DEVICES may reorder)
            import torch

            bus = torch.cuda.get_device_properties(index).pci_bus_id  # type: ignore[attr-defined]
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        info: dict[str, Any] = {"gpu_name": text(pynvml.nvmlDeviceGetName(handle)),
                                "driver": text(pynvml.nvmlSystemGetDriverVersion())}
        try:
            cur = (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle), pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
            top = (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle), pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
            info["pcie_link"] = f"Gen{cur[0]} x{cur[1]} (max Gen{top[0]} x{top[1]})"
        except Exception:  # noqa: BLE001
            info["pcie_link"] = "unknown"
        return info
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _smi(index: int) -> dict[str, Any] | None:
    try:
        res = subprocess.run(["nvidia-smi", "-i", str(index), "--format=csv,noheader",
                              "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,"
                              "pcie.link.gen.max,pcie.link.width.max"],
                             capture_output=True, text=True, timeout=10.0, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0 or not res.stdout.strip():
        return None
    parts = [p.strip() for p in res.stdout.splitlines()[0].split(",")]
    if len(parts) < 6:
        return None
    return {"gpu_name": parts[0], "driver": parts[1],
            "pcie_link": f"Gen{parts[2]} x{parts[3]} (max Gen{parts[4]} x{parts[5]})"}


def gpu_info(index: int) -> dict[str, Any] | None:
    """``{"gpu_name", "driver", "pcie_link"}`` of GPU ``index``, or None where neither source answers."""
    return _nvml(index) or _smi(index)
