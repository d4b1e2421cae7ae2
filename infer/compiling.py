"""One way to compile a decoding step: ``compiled(fn, compile, device)``.

``compile`` is the generator's one switch: False = eager; True = inductor (on CUDA with CUDA graphs,
mode "reduce-overhead": small-batch decoding is launch-bound); a string names another
``torch.compile`` backend (tests trace with "aot_eager" or "eager" on CPU). Shapes are static
(``dynamic=False``): a step is compiled once per shape it sees.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch


def check_compile(compile: object) -> bool | str | None:
    """``compile`` as a generator takes it: None (the device's default), True/False, or the name of a
    ``torch.compile`` backend; anything else is refused here rather than read as true."""
    if compile is None or isinstance(compile, bool):
        return compile
    if isinstance(compile, str):
        backends = torch._dynamo.list_backends(exclude_tags=())
        if compile in backends:
            return compile
        raise ValueError(f"compile={compile!r} is not a torch.compile backend ({', '.join(sorted(backends))})")
    raise ValueError(f"compile must be True, False, None or a torch.compile backend name, got {compile!r}")


def compiled(fn: Callable, compile: bool | str, device: torch.device) -> Callable:
    if not compile:
        return fn
    # Every generator compiles the same functions, and dynamo's per-function limit of 8 graphs is
    # shared by all of them (targets x tree budgets x cache sizes): past it dynamo would silently run
    # eagerly. Raise it; each entry is one (model, budget, cache size).
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if limit is not None and limit < 64:
        torch._dynamo.config.recompile_limit = 64
    if isinstance(compile, str):
        return torch.compile(fn, backend=compile, dynamic=False)
    if torch.device(device).type == "cuda":  # CUDA graphs remove the per-kernel launch cost
        return torch.compile(fn, mode="reduce-overhead", dynamic=False)
    # With ATen pinned to its default kernels (ATEN_CPU_CAPABILITY=default) inductor's vectorised C++
    # fails to compile (its at::vec types are not there); scalar code then, as on a CPU without a
    # vector instruction set.
    scalar = os.environ.get("ATEN_CPU_CAPABILITY") == "default"
    return torch.compile(fn, dynamic=False, options={"cpp.simdlen": 1} if scalar else None)


def step_begin(device: torch.device) -> None:
    """Before a compiled call on CUDA: the outputs of the last CUDA-graph replay (already used) may be
    overwritten now."""
    if torch.device(device).type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
