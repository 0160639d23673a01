"""The stream and event operations the copy backend uses, behind one interface.

So the copy protocol (slots, events, the WAR wait, failure delivery, shutdown) is testable without a
GPU: :class:`CudaOps` drives real streams and events, :class:`CpuOps` runs everything synchronously on
CPU tensors, and the tests inject a fake whose copies complete only when the test says.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DeviceOps", "CudaOps", "CpuOps", "ops_for"]


class DeviceOps(abc.ABC):
    """The few stream/event operations the backend uses, so the protocol is testable without a GPU.

    ``enqueue(stream, fn)`` runs ``fn`` (which issues device work, e.g. ``dst.copy_(src)``) in the order
    of ``stream``. Implementations: :class:`CudaOps` (real streams and events), :class:`CpuOps`
    (everything synchronous; CPU tensors), and in the tests a fake whose work runs only when told.
    """

    device: torch.device

    @abc.abstractmethod
    def current_stream(self) -> Any:
        ...

    @abc.abstractmethod
    def new_stream(self) -> Any:
        ...

    @abc.abstractmethod
    def new_event(self) -> Any:
        ...

    @abc.abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        ...

    @abc.abstractmethod
    def query(self, event: Any) -> bool:
        """True when all work before the event's latest record has completed (or it was never recorded)."""
        ...

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Work enqueued on ``stream`` after this call waits for the event's latest record."""
        ...

    @abc.abstractmethod
    def enqueue(self, stream: Any, fn: Callable[[], None]) -> None:
        ...

    @abc.abstractmethod
    def needs_d2h(self, ids: torch.Tensor) -> bool:
        """True when ``ids`` live on the device and must be copied to the host before the CPU gather."""
        ...

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        ...

    @abc.abstractmethod
    def alloc_device(self, numel: int, dtype: torch.dtype, stream: Any) -> torch.Tensor:
        ...

    def check_device(self, t: torch.Tensor, what: str) -> None:
        if t.device != self.device:
            raise ValueError(f"{what} is on {t.device}, the backend on {self.device}; move it there")


class CudaOps(DeviceOps):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> Any:
        return torch.cuda.Event(enable_timing=False, blocking=False)

    def record(self, event: Any, stream: Any) -> None:
        with torch.cuda.device(self.device):
            event.record(stream)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def enqueue(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            fn()

    def needs_d2h(self, ids: torch.Tensor) -> bool:
        return ids.device.type == "cuda"

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def alloc_device(self, numel: int, dtype: torch.dtype, stream: Any) -> torch.Tensor:
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            return torch.empty(numel, dtype=dtype, device=self.device)

    def check_device(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != "cuda" or t.device.index != self.device.index:
            raise ValueError(f"{what} is on {t.device}, the backend on {self.device}; move it there")


class CpuOps(DeviceOps):
    """Synchronous stand-in: the 'device' is the CPU, every enqueued operation runs at once."""

    device = torch.device("cpu")

    def current_stream(self) -> Any:
        return None

    def new_stream(self) -> Any:
        return None

    def new_event(self) -> Any:
        return None

    def record(self, event: Any, stream: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def enqueue(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def needs_d2h(self, ids: torch.Tensor) -> bool:
        return False

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_device(self, numel: int, dtype: torch.dtype, stream: Any) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)


def ops_for(device: torch.device | str | int | None) -> DeviceOps:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return CudaOps(device)
    if device.type == "cpu":
        return CpuOps()
    raise ValueError(f"CopyBackend supports cuda and cpu devices, not {device}")
