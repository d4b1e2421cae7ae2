"""Shared fixtures: tiny HF targets built in-process from configs (no downloads)."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

ARCHES = ("llama", "qwen2", "qwen3", "mistral")

_CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


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


def free_port() -> int:
    """A TCP port free right now, for a test's ``--main_process_port``: a fixed one would collide with the
    same test on another xdist worker or another checkout's suite on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_target(
    arch: str = "llama",
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 256,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **extra,
):
    """A randomly initialised causal LM of the given family, in eval mode.

    ``num_layers`` defaults to 6 so EAGLE-3's default aux layers [2, L//2, L-3] = [2, 3, 3]
    are valid; pass ``num_layers=8`` for three distinct ones.
    """
    cls = _CONFIGS[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def make_successor_target(vocab_size: int = 96):
    """A tiny Llama whose greedy continuation is mostly learnable: its lm_head maps each token's
    embedding to a fixed successor, and attention and MLP stay as a small perturbation."""
    model = make_tiny_target("llama", vocab_size=vocab_size, initializer_range=0.3)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))
        embed = model.get_input_embeddings().weight
        model.get_output_embeddings().weight.copy_(embed[torch.argsort(successor)])  # logit of succ(t) ~ |e_t|^2
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return model


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
    os.environ["OMP_NUM_THREADS"] = wanted  # the thread policy (infer.threads) then keeps it, unprobed
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


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def record_drafts(drafter) -> list:
    """Every draft ``drafter`` proposes from now on, as the generator asks for them (``propose_rows``:
    every row of a step at once), appended to the returned list."""
    drafts, propose_rows = [], drafter.propose_rows

    def recording(*args, **kwargs):
        out = propose_rows(*args, **kwargs)
        drafts.extend(out)
        return out

    drafter.propose_rows = recording
    return drafts
