"""Which device a lookup or a hot set is on: one rule for both (a bare ``cuda`` is the current device)."""

from __future__ import annotations

import torch

__all__ = ["default_device", "resolve_device"]


def default_device() -> torch.device:
    """The current CUDA device, or the CPU where there is none (kernels then run interpreted)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device) -> torch.device:
    """A lookup's device: None is :func:`default_device`, an int or a bare ``cuda`` the indexed CUDA device."""
    if device is None:
        return default_device()
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"a lookup runs on cuda or cpu devices, not {device}")
    return device
