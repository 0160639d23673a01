"""``uvaple doctor``: can this machine run the UVA path, and how fast can it read host memory?

Reports CUDA presence, device name, unified addressing, can-map-host-memory, host-pointer-for-registered-
memory, read-only registration, the PCIe link (NVML where present), the memlock limit, free host memory,
and two short measurements: the pinned host-to-device copy ceiling and the zero-copy read rate of the
gather kernel from a registered table. Exit 0 when the UVA path is usable, 1 with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

from . import _cuda, _sys


@dataclass
class Capabilities:
    cuda: bool = False
    reason: str = ""
    device_index: int | None = None
    device_name: str | None = None
    driver_version: str | None = None
    unified_addressing: bool | None = None
    can_map_host_memory: bool | None = None
    host_pointer_for_registered_mem: bool | None = None
    host_register_supported: bool | None = None
    read_only_register: bool | None = None
    pcie_link: str | None = None
    memlock_soft_bytes: int | None = None
    mem_available_bytes: int | None = None
    h2d_ceiling_gbps: float | None = None
    zero_copy_read_gbps: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def uva_usable(self) -> bool:
        return bool(self.cuda and self.unified_addressing and self.can_map_host_memory
                    and self.host_pointer_for_registered_mem)


def _pcie_link(device: int) -> str | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(device)
            cur = (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h), pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
            top = (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
            return f"Gen{cur[0]} x{cur[1]} (max Gen{top[0]} x{top[1]})"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVML is optional and varies by driver
        return f"unknown ({type(e).__name__})"


def _measure(device: int, seconds: float) -> tuple[float, float]:
    """(pinned H2D GB/s, zero-copy gather GB/s) over ~``seconds`` in total."""
    import torch

    from ..kernels import gather_rows
    from .host_table import HostTable

    nbytes = 256 << 20
    dev = torch.device("cuda", device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def rate(fn, moved: int, budget: float) -> float:
        fn()
        torch.cuda.synchronize(dev)
        times, t_end = [], time.perf_counter() + budget
        while time.perf_counter() < t_end or len(times) < 3:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        times.sort()
        return moved / times[len(times) // 2] / 1e9

    h2d = rate(lambda: dst.copy_(src, non_blocking=True), nbytes, seconds / 2)
    row_bytes = 17920  # a Gemma 3n E4B per-layer-embedding row
    rows = (1 << 30) // row_bytes
    with HostTable.empty(rows, row_bytes // 2, torch.bfloat16, device=device, register=True) as table:
        n = 16384
        ids = torch.randint(0, rows, (n,), device=dev)
        out = torch.empty((n, table.cols), dtype=table.dtype, device=dev)
        zc = rate(lambda: gather_rows(table, ids, out), n * row_bytes, seconds / 2)
    return h2d, zc


def capabilities(measure: bool = True, seconds: float = 2.0, device: int | None = None) -> Capabilities:
    """Probe this machine for the UVA path (``measure``: also time the two ~``seconds`` benchmarks)."""
    caps = Capabilities()
    soft, _ = _sys.memlock_limit()
    caps.memlock_soft_bytes = soft
    caps.mem_available_bytes = _sys.mem_available_bytes()
    try:
        import torch
    except ImportError:
        caps.reason = "torch is not installed"
        return caps
    if not torch.cuda.is_available():
        caps.reason = "no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
        return caps
    if _cuda.runtime() is None:
        caps.reason = "cuda-python is not installed (pip install cuda-python)"
        return caps
    if not _cuda.cuda_available():
        caps.reason = "cuda-python cannot reach a GPU (cudaGetDeviceCount failed)"
        return caps
    caps.cuda = True
    dev = torch.cuda.current_device() if device is None else device
    caps.device_index = dev
    caps.device_name = torch.cuda.get_device_name(dev)
    rt = _cuda.runtime()
    err, ver = rt.cudaDriverGetVersion()
    caps.driver_version = f"{ver // 1000}.{ver % 1000 // 10}" if int(err) == 0 else None

    def attr(name: str) -> bool | None:
        try:
            return _cuda.device_attribute(name, dev) == 1
        except Exception:  # noqa: BLE001 - an attribute missing from this cuda-python
            return None

    caps.unified_addressing = attr("cudaDevAttrUnifiedAddressing")
    caps.can_map_host_memory = attr("cudaDevAttrCanMapHostMemory")
    caps.host_pointer_for_registered_mem = attr("cudaDevAttrCanUseHostPointerForRegisteredMem")
    caps.host_register_supported = attr("cudaDevAttrHostRegisterSupported")
    caps.read_only_register = attr("cudaDevAttrHostRegisterReadOnlySupported")
    caps.pcie_link = _pcie_link(dev)
    if not caps.uva_usable:
        missing = [n for n, v in [("unified addressing", caps.unified_addressing),
                                  ("can map host memory", caps.can_map_host_memory),
                                  ("host pointer for registered memory", caps.host_pointer_for_registered_mem)]
                   if not v]
        caps.reason = "the GPU lacks " + ", ".join(missing) + "; use the 'copy' backend"
        return caps
    if measure:
        try:
            caps.h2d_ceiling_gbps, caps.zero_copy_read_gbps = _measure(dev, seconds)
        except Exception as e:  # noqa: BLE001 - report, do not hide, a failing measurement
            caps.reason = f"the zero-copy measurement failed: {type(e).__name__}: {e}"
            caps.notes.append("registration or the gather kernel failed; see reason")
    return caps


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 0 or n >= (1 << 62):
        return "unlimited"
    if n < (1 << 30):
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.1f} GiB"


def format_report(caps: Capabilities) -> str:
    yes = {True: "yes", False: "NO", None: "unknown"}
    lines = [
        f"CUDA                          : {yes[caps.cuda]}",
        f"device                        : {caps.device_name or '-'} (index {caps.device_index})",
        f"driver                        : {caps.driver_version or '-'}",
        f"unified addressing            : {yes[caps.unified_addressing]}",
        f"can map host memory           : {yes[caps.can_map_host_memory]}",
        f"host ptr for registered mem   : {yes[caps.host_pointer_for_registered_mem]}",
        f"host register supported       : {yes[caps.host_register_supported]}",
        f"read-only registration        : {yes[caps.read_only_register]}",
        f"PCIe link                     : {caps.pcie_link or 'unknown (NVML not available)'}",
        f"memlock limit (ulimit -l)     : {_fmt_bytes(caps.memlock_soft_bytes)}",
        f"host memory available         : {_fmt_bytes(caps.mem_available_bytes)}",
    ]
    if caps.h2d_ceiling_gbps is not None:
        lines.append(f"pinned H2D copy ceiling       : {caps.h2d_ceiling_gbps:.1f} GB/s")
        lines.append(f"zero-copy gather read         : {caps.zero_copy_read_gbps:.1f} GB/s "
                     f"({caps.zero_copy_read_gbps / caps.h2d_ceiling_gbps:.2f}x the copy ceiling)")
    ok = caps.uva_usable and not caps.reason
    lines.append(f"UVA path usable               : {'yes' if ok else 'NO: ' + caps.reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="uvaple doctor", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--no-measure", action="store_true", help="skip the two ~1 s bandwidth measurements")
    p.add_argument("--seconds", type=float, default=2.0, help="time spent measuring (default 2)")
    a = p.parse_args(argv)
    caps = capabilities(measure=not a.no_measure, seconds=a.seconds)
    if a.json:
        print(json.dumps(dict(asdict(caps), uva_usable=caps.uva_usable), indent=2))
    else:
        print(format_report(caps))
    return 0 if caps.uva_usable and not caps.reason else 1


if __name__ == "__main__":
    raise SystemExit(main(os.sys.argv[1:]))
