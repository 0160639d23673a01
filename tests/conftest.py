"""Test setup: the compute device, GPU-only tests, the extended set, and deterministic property tests.

Without a GPU the kernels run under Triton's interpreter on CPU tensors: uvaple chooses the interpreter
per launch from the tensors' device, so nothing needs to be set here.

The extended set (tests marked ``extended``: more parametrisations, rounds and schedules of checks the
default set also makes, and the longer smokes) is left out of a run without CUDA that names no marker
(``-m``) and no test (``file::name``): ``python3 -m pytest`` is the default set, ``python3 -m pytest -m
extended`` the rest, ``-m "extended or not extended"`` both. With CUDA (compiled kernels) every run
includes it, as ``perf/gpu_check.sh`` expects. ``tests/README.md`` lists what it holds.

Workers (``-n auto``, pytest-xdist, the README's test command): without CUDA one worker process a core, at
most four, each running whole test files (a file's module fixtures are built once, and its tests run in
their order); with CUDA one process, since ``perf/gpu_check.sh`` runs its own groups of files side by side on
the one GPU. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` sets the count; ``-n 0`` runs in one process.

Hypothesis: the default profile (``uvaple``) is derandomised with no example database, so every run of
the suite (CI's included) draws the same examples; ``--hypothesis-profile=explore`` draws fresh random
examples (``--hypothesis-seed=N`` to replay one).
"""

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("uvaple", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, database=None)
settings.load_profile("uvaple")

HAS_CUDA = torch.cuda.is_available()
MAX_WORKERS = 4  # the interpreted suite's largest files bound it beyond that; each worker imports torch


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own reading of it
    if HAS_CUDA:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # Linux, others
    return max(1, min(cores or 1, MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    if not config.option.markexpr and not any("::" in a for a in config.args):
        extended = [item for item in items if item.get_closest_marker("extended")]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if not item.get_closest_marker("extended")]
    skip = pytest.mark.skip(reason="needs CUDA: runs on the GPU machine (perf/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The compute device: CUDA where present, else CPU (interpreter)."""
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")
