"""The suite's hooks and shared fixtures; the helpers they build on are in tests/support/ (tiny HF targets built
in-process from configs, no downloads)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from support.targets import ARCHES, has_cuda, make_tiny_target


# `python -m pytest` puts the repository root on sys.path, where heads/, infer/, data/ ... would import under
# their bare names: a stray `import infer.tree` (or importlib.import_module("infer.tree")) would pass here and
# fail for every user of the wheel. Our code imports as draftsmith.<folder> only (through the install).
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

MAX_WORKERS = 4  # each xdist worker imports torch and transformers (~1 GB): more cores than this do not pay


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown when xdist is off
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker per usable core, at most MAX_WORKERS, so a 16-core GPU
    machine does not start 16 torch imports; ``DRAFTSMITH_TEST_WORKERS=N`` overrides (0: one process). A
    single test file runs in this process: ``--dist=loadfile`` gives a file one worker, and starting
    workers would only add their imports."""
    wanted = os.environ.get("DRAFTSMITH_TEST_WORKERS")
    if wanted is not None:
        return int(wanted)
    files = {arg.split("::")[0] for arg in config.args}
    if len(files) == 1 and os.path.isfile(next(iter(files))):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS)


def pytest_addoption(parser, pluginmanager):
    """Without pytest-xdist (``-p no:xdist``, or not installed) addopts' ``--numprocesses=auto --dist=loadfile``
    would be unknown options: accept and ignore them, and the suite runs in this one process."""
    if pluginmanager.has_plugin("xdist"):
        return
    parser.addoption("--numprocesses", dest="numprocesses", default=None, help="ignored: pytest-xdist is off")
    parser.addoption("--dist", dest="dist", default="no", help="ignored: pytest-xdist is off")


@pytest.fixture(params=ARCHES)
def arch(request):
    return request.param


@pytest.fixture
def tiny_llama():
    return make_tiny_target("llama", num_layers=8)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models on 2 cores: one intra-op thread avoids OpenMP contention (10-50x faster here)."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    wanted = os.environ.get("DRAFTSMITH_TEST_THREADS", "1")  # e.g. 2: check tolerances at another count
    torch.set_num_threads(int(wanted))
    os.environ["OMP_NUM_THREADS"] = wanted  # the thread policy (target.threads) then keeps it, unprobed
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """accelerate keeps one process-wide state: a test that builds Accelerator(cpu=True) or another
    mixed precision would make every later Accelerator in this process fail on a CUDA machine."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


