"""``uvaple doctor``: what this machine can run, and how fast it reads host memory.

Reports CUDA presence, device name, unified addressing, can-map-host-memory, host-pointer-for-registered-
memory, read-only registration, the PCIe link (NVML where present), the memlock limit, free host memory,
and two short measurements: the pinned host-to-device copy ceiling and the zero-copy read rate of the
gather from a registered table. Without a usable GPU it says what runs instead (host tables, shared
tables, the copy placement and the kernels on CPU tensors), and measures those. Its last line is the
verdict, with the reason (on stderr with ``--json``, whose stdout is the JSON alone, ``exit_status`` and
``verdict`` included).

Exit status (:data:`EXIT_STATUS`):

* 0: the UVA path is usable here (and, unless ``--no-measure``, its measurement ran);
* 1: the GPU has what the UVA path needs, but registering a table or the gather failed in the measurement
  (the reason names the error: a problem to investigate, not a missing capability);
* 2: a usage error (an unknown option);
* 3: the answer is "no usable GPU for the UVA path here": no CUDA GPU visible to torch, the CPU build of
  torch, no cuda-python, or a GPU without unified addressing / mapped host memory (the report says what
  runs instead).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from uvaple.dtypes import fmt_bytes
from uvaple.machine import gpu_info
from uvaple.uva import cuda_runtime, system

#: exit status -> what it means (the module docstring)
EXIT_STATUS = {
    0: "the UVA path is usable here",
    1: "the GPU has the UVA path's capabilities, but its measurement failed",
    2: "usage error",
    3: "no usable GPU for the UVA path here",
}


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
    shm_huge_pages: str | None = None  # the huge= option of /dev/shm's tmpfs (shared tables' page size)
    h2d_ceiling_gbps: float | None = None
    zero_copy_read_gbps: float | None = None
    torch_build: str | None = None  # "cuda 13.0" or "cpu"
    cpu_copy_gbps: float | None = None  # without a usable GPU: the copy placement on the CPU
    cpu_interpreter_rows_per_s: float | None = None  # without a usable GPU: the Triton gather, interpreted
    eager_call: str | None = None  # with a GPU: the eager C call built, or why eager calls take the Python path
    notes: list[str] = field(default_factory=list)

    @property
    def uva_usable(self) -> bool:
        return bool(self.cuda and self.unified_addressing and self.can_map_host_memory
                    and self.host_pointer_for_registered_mem)


def _measure(device: int, seconds: float) -> tuple[float, float]:
    """(pinned H2D GB/s, zero-copy gather GB/s), each the median of ~``seconds / 2`` of event-timed runs."""
    import torch
    from triton.testing import do_bench

    from uvaple.integration import make_lookup
    from uvaple.uva import HostTable

    nbytes = 256 << 20
    dev = torch.device("cuda", device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ms = seconds / 2 * 1e3
    with torch.cuda.device(dev):
        h2d = nbytes / (do_bench(lambda: dst.copy_(src, non_blocking=True), rep=ms, return_mode="median") / 1e3)
        row_bytes = 17920  # a Gemma 3n E4B per-layer-embedding row
        rows = (1 << 30) // row_bytes
        with HostTable.empty(rows, row_bytes // 2, torch.bfloat16, device=device, register=True) as table:
            lookup = make_lookup("uva", table, device=dev)
            n = 16384
            ids = torch.randint(0, rows, (n,), device=dev)
            out = torch.empty((n, table.cols), dtype=table.dtype, device=dev)
            t = do_bench(lambda: lookup.lookup(ids, out), rep=ms, return_mode="median") / 1e3
            lookup.close()
    return h2d / 1e9, n * row_bytes / t / 1e9


def _measure_cpu(seconds: float) -> tuple[float, float]:
    """(copy placement GB/s, interpreted gather rows/s) on the CPU, ~``seconds`` in all."""
    import torch

    from uvaple.integration import make_lookup
    from uvaple.uva import HostTable

    row_bytes = 17920
    rows = (64 << 20) // row_bytes
    with HostTable.empty(rows, row_bytes // 2, torch.bfloat16) as table:
        table.tensor.view(torch.int16).random_(-(1 << 14), 1 << 14)
        rates = []
        for kind, n in (("copy", 4096), ("uva", 16)):
            with make_lookup(kind, table, device="cpu") as lookup:
                ids = torch.randint(0, rows, (n,))
                out = torch.empty(n, table.cols, dtype=table.dtype)
                lookup.lookup(ids, out)  # warm (numba / the interpreter's rewrite)
                reps, t0 = 0, time.perf_counter()
                while reps < 3 or time.perf_counter() - t0 < seconds / 2:
                    lookup.lookup(ids, out)
                    reps += 1
                rates.append(reps * n / (time.perf_counter() - t0))
    return rates[0] * row_bytes / 1e9, rates[1]


def capabilities(measure: bool = True, seconds: float = 2.0, device: int | None = None,
                 say: Callable[[str], object] | None = None) -> Capabilities:
    """Probe this machine for the UVA path (``measure``: also time the two ~``seconds`` benchmarks; ``say``: told
    what is being checked, before each step that takes a while)."""
    say = say or (lambda _msg: None)
    caps = Capabilities()
    soft, _ = system.memlock_limit()
    caps.memlock_soft_bytes = soft
    caps.mem_available_bytes = system.mem_available_bytes()
    caps.shm_huge_pages = system.huge_pages_in("/dev/shm")
    say("checking torch and CUDA (importing torch takes a few seconds)")
    try:
        import torch
    except ImportError:
        caps.reason = "torch is not installed"
        return caps
    caps.torch_build = f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu"
    if not torch.cuda.is_available():
        caps.reason = ("no CUDA GPU is visible to torch (torch.cuda.is_available() is False)"
                       + ("; this torch is the CPU build" if not torch.version.cuda else ""))
        if measure:
            say(f"no GPU: timing the copy placement and the interpreted gather on the CPU (about {seconds:g} s, and "
                "the Triton interpreter's start; --no-measure skips this)")
            caps.cpu_copy_gbps, caps.cpu_interpreter_rows_per_s = _measure_cpu(seconds)
        return caps
    if cuda_runtime.runtime() is None:
        caps.reason = "cuda-python is not installed (pip install cuda-python)"
        return caps
    if not cuda_runtime.cuda_available():
        caps.reason = "cuda-python cannot reach a GPU (cudaGetDeviceCount failed)"
        return caps
    caps.cuda = True
    dev = torch.cuda.current_device() if device is None else device
    caps.device_index = dev
    caps.device_name = torch.cuda.get_device_name(dev)
    rt = cuda_runtime.runtime()
    err, ver = rt.cudaDriverGetVersion()
    caps.driver_version = f"{ver // 1000}.{ver % 1000 // 10}" if int(err) == 0 else None

    def attr(name: str) -> bool | None:
        try:
            return cuda_runtime.device_attribute(name, dev) == 1
        except Exception:  # noqa: BLE001 - an attribute missing from this cuda-python
            return None

    caps.unified_addressing = attr("cudaDevAttrUnifiedAddressing")
    caps.can_map_host_memory = attr("cudaDevAttrCanMapHostMemory")
    caps.host_pointer_for_registered_mem = attr("cudaDevAttrCanUseHostPointerForRegisteredMem")
    caps.host_register_supported = attr("cudaDevAttrHostRegisterSupported")
    caps.read_only_register = attr("cudaDevAttrHostRegisterReadOnlySupported")
    caps.pcie_link = (gpu_info(dev) or {}).get("pcie_link")
    from uvaple.kernels import eager_call

    say("building the eager call (C, once: cached)")
    why = eager_call.unavailable()
    caps.eager_call = "built" if why is None else f"not used ({why}): eager calls take the Python path"
    if not caps.uva_usable:
        missing = [n for n, v in [("unified addressing", caps.unified_addressing),
                                  ("can map host memory", caps.can_map_host_memory),
                                  ("host pointer for registered memory", caps.host_pointer_for_registered_mem)]
                   if not v]
        caps.reason = "the GPU lacks " + ", ".join(missing) + "; use the 'copy' backend"
        return caps
    if measure:
        say(f"{caps.device_name}: building a 1 GiB registered table, then timing the pinned copy and the zero-copy "
            f"gather (about {seconds:g} s; --no-measure skips this)")
        try:
            caps.h2d_ceiling_gbps, caps.zero_copy_read_gbps = _measure(dev, seconds)
        except Exception as e:  # noqa: BLE001 - report, do not hide, a failing measurement
            caps.reason = f"the zero-copy measurement failed: {type(e).__name__}: {e}"
            caps.notes.append("registration or the gather kernel failed; see reason")
    return caps


def _limit(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 0 or n >= (1 << 62):
        return "unlimited"
    return fmt_bytes(n)


def _shm_pages(huge: str | None) -> str:
    if huge is None:
        return "unknown (no tmpfs at /dev/shm)"
    if huge in ("always", "within_size"):
        return f"2 MiB pages (huge={huge})"
    return (f"4 KiB pages (huge={huge}); for a faster start mount a tmpfs with huge=always and give it as the "
            "segment directory (directory=, or the vLLM plugin's segment_dir)")


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
        f"memlock limit (ulimit -l)     : {_limit(caps.memlock_soft_bytes)}",
        f"host memory available         : {_limit(caps.mem_available_bytes)}",
        f"shared tables in /dev/shm     : {_shm_pages(caps.shm_huge_pages)}",
    ]
    if caps.eager_call is not None:
        lines.append(f"eager lookup call in C        : {caps.eager_call}")
    if caps.h2d_ceiling_gbps is not None:
        lines.append(f"pinned H2D copy ceiling       : {caps.h2d_ceiling_gbps:.1f} GB/s")
        lines.append(f"zero-copy gather read         : {caps.zero_copy_read_gbps:.1f} GB/s "
                     f"({caps.zero_copy_read_gbps / caps.h2d_ceiling_gbps:.2f}x the copy ceiling)")
    ok = caps.uva_usable and not caps.reason
    lines.append(f"torch build                   : {caps.torch_build or '-'}")
    lines.append(f"UVA path usable               : {'yes' if ok else 'NO: ' + caps.reason}")
    if not ok:
        lines += ["", "What runs here instead:"]
        if caps.cuda:
            lines.append("  - the 'copy' placement: a CPU gather into pinned staging and one copy to the GPU "
                         "(make_lookup('copy', table))")
        else:
            lines += [
                "  - host tables: HostTable (private or shared between processes), loading from safetensors",
                "  - every lookup placement on CPU tensors (ids and output on the CPU), same bits as on a GPU:",
            ]
            if caps.cpu_copy_gbps is not None:
                lines += [f"      copy placement (numba gather)        : {caps.cpu_copy_gbps:.2f} GB/s of "
                          f"17,920-byte rows",
                          f"      uva/device (Triton interpreter)      : {caps.cpu_interpreter_rows_per_s:,.0f} "
                          f"rows/s (for tests and development, not serving)"]
            lines.append("  - for the GPU path: a CUDA GPU with the CUDA build of torch; pip installs the CUDA "
                         "build unless the CPU build was installed first (pip install torch --index-url "
                         "https://download.pytorch.org/whl/cpu)")
    return "\n".join(lines)


def exit_status(caps: Capabilities) -> int:
    """0, 1 or 3 for ``caps`` (:data:`EXIT_STATUS`; 2 is argparse's, for a usage error)."""
    if not caps.uva_usable:
        return 3
    return 1 if caps.reason else 0


def verdict(caps: Capabilities) -> str:
    """The last line: the exit status, what it means and the reason."""
    code = exit_status(caps)
    why = f": {caps.reason}" if caps.reason else ""
    return f"uvaple doctor: exit {code}: {EXIT_STATUS[code]}{why}"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="uvaple doctor",
        description="What this machine can run (the UVA path, the copy path, CPU tensors), and how fast it reads "
                    "host memory.",
        epilog="exit status: " + "; ".join(f"{k} {v}" for k, v in EXIT_STATUS.items()) + ". The last line says "
               "which, and why (on stderr with --json).")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table (exit_status and verdict "
                                                       "included)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the measurements (with a GPU: the pinned copy and the zero-copy gather; without: the "
                        "copy placement and the interpreted gather)")
    from uvaple.perf.command import number

    p.add_argument("--seconds", type=number(noun="a number of seconds", hint="--no-measure skips the measurements"),
                   default=2.0,
                   help="time the measurements take together (default 2; a GPU's also builds a 1 GiB table)")
    a = p.parse_args(argv)
    caps = capabilities(measure=not a.no_measure, seconds=a.seconds,
                        say=lambda msg: print(f"uvaple doctor: {msg}", file=sys.stderr, flush=True))
    code, said = exit_status(caps), verdict(caps)
    if a.json:
        print(json.dumps(dict(asdict(caps), uva_usable=caps.uva_usable, exit_status=code, verdict=said), indent=2))
        print(said, file=sys.stderr)
    else:
        print(format_report(caps))
        print(said)
    return code


if __name__ == "__main__":
    raise SystemExit(main(os.sys.argv[1:]))
