"""Test setup: run kernels under Triton's interpreter on CPU tensors when no GPU is present.

This must happen before Triton-decorated functions are defined, so it sits at the top of conftest.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA: runs on the GPU machine (perf/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The compute device: CUDA where present, else CPU (interpreter)."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")
