"""vLLM plugin tests: vLLM's own modules built on the CPU (kernels interpreted), compared bit for bit.

Run in an environment with vLLM 0.33 installed (README: "vLLM plugin tests"). One process holds one
distributed environment (gloo, world 1, which also sets up vLLM's ETP group); tests that need several
ranks or processes start their own.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM plugin tests need vLLM installed (README: vLLM plugin tests)")

# vLLM's CUDA wheel on a machine without a GPU resolves no platform, and then no attention backend for
# the model classes; these tests build the models on vLLM's CPU platform (this test process only).
import vllm.platforms as _platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

_platforms._current_platform = CpuPlatform()

# On a CPU with AMX, vLLM's CPU platform packs small bf16 linear weights with an op of its CPU build
# (torch.ops._C.convert_weight_packed) that its CUDA wheel does not have: the model builds of these tests
# would fail on such a machine and pass on another. Where the op is missing, the linears take vLLM's other
# CPU path (oneDNN), which the per-layer embedding under test never touches.
import vllm.model_executor.layers.utils as _layer_utils  # noqa: E402

if not hasattr(torch.ops._C, "convert_weight_packed"):
    _layer_utils.check_cpu_sgl_kernel = lambda n, k, dtype: False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_config(**kw):
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device="cpu"), **kw)


def init_dist(world_size: int = 1, rank: int = 0, port: int | None = None, tp: int = 1) -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    initialize_model_parallel(tp, 1)


@pytest.fixture(scope="session", autouse=True)
def dist():
    """vLLM's config context and a world-1 gloo group for the whole session."""
    from vllm.config import set_current_vllm_config

    for var in [k for k in os.environ if k.startswith("UVAPLE_")]:
        os.environ.pop(var)
    with set_current_vllm_config(vllm_config()):
        init_dist()
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def rand(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * 3
    t[t == 0] = 1.25
    return t.to(dtype)
