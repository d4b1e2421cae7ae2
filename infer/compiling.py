"""One way to compile a decoding step: ``compiled(fn, compile, device, owner)``.

``compile`` is the generator's one switch: False = eager; True = inductor (on CUDA with CUDA graphs,
mode "reduce-overhead": small-batch decoding is launch-bound); a string names another
``torch.compile`` backend (tests trace with "aot_eager" or "eager" on CPU). Shapes are static
(``dynamic=False``): a step is compiled once per shape it sees.

Each ``owner`` (the target a verify runs, the head a draft step runs) compiles its own copy of the function:
dynamo keeps its graphs on the function's code object, so one code object shared by two models holds the first
model's guards when the second compiles, and on a recompile torch (2.13) evaluates those guards' sources against
the second model, which raises where that model lacks the first one's module (``KeyError: 'rotary_emb'`` going from
LFM3 to Kimi-Linear, tests/infer/test_infer_compiled_targets.py). A graph of one model never served another anyway
(its guards hold the model's own modules); generators of one owner still share theirs.
"""
from __future__ import annotations

import os
import types
import weakref
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


def compiled(fn: Callable, compile: bool | str, device: torch.device, owner: object) -> Callable:
    """``fn`` (a function or a bound method) compiled per ``compile`` (False: ``fn`` itself), as ``owner``'s copy."""
    if not compile:
        return fn
    fn = owned_copy(fn, owner)
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


# owner -> {a function's code object: the owner's copy of that function}
_COPIES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def owned_copy(fn: Callable, owner: object) -> Callable:
    """``fn`` with a code object of ``owner``'s own (the same copy on every call for one owner and function): a
    bound method stays bound to its instance."""
    func = getattr(fn, "__func__", fn)
    copies = _COPIES.setdefault(owner, {})
    copy = copies.get(func.__code__)
    if copy is None:
        copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                                  func.__closure__)
        copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
        copies[func.__code__] = copy
    return types.MethodType(copy, fn.__self__) if hasattr(fn, "__func__") else copy


def step_begin(device: torch.device) -> None:
    """Before a compiled call on CUDA: the outputs of the last CUDA-graph replay (already used) may be
    overwritten now."""
    if torch.device(device).type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
