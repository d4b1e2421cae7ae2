"""The keyword a transformers forward takes its KV cache by, and the field it returns it in.

transformers 5.24 renamed ``past_key_values`` to ``cache``: forwards still take the old keyword with a
``FutureWarning`` (removal in 5.40) and outputs still answer ``.past_key_values`` with a logged warning;
5.17 knows only ``past_key_values``. Every call into a transformers model that passes or reads a cache
goes through here, so the code runs on both without warnings. See docs/design.md.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
from torch import nn

_NAMES = ("cache", "past_key_values")  # newest first


@functools.cache
def _keyword(cls: type) -> str:
    """The cache keyword of ``cls.forward``, read from its signature once per class (transformers'
    deprecation decorator keeps the wrapped signature). A forward taking only ``**kwargs`` (a wrapper)
    gets the installed transformers' name."""
    params = inspect.signature(cls.forward).parameters
    for name in _NAMES:
        if name in params:
            return name
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _installed_name()
    raise TypeError(f"{cls.__name__}.forward takes no KV cache (neither cache= nor past_key_values=)")


@functools.cache
def _installed_name() -> str:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    fields = {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


@torch.compiler.assume_constant_result
def _traced_keyword(cls: type) -> str:
    """``_keyword`` as a compiled caller (masked_forward under torch.compile) reads it: a constant,
    without tracing the signature lookup."""
    return _keyword(cls)


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call ``model(..., **cache_kwargs(model, cache))``."""
    return {_traced_keyword(type(model)): cache}


def returned_cache(out: Any) -> Any:
    """The cache a transformers forward returned (``out.cache`` from 5.24 on, ``out.past_key_values``
    before), read without touching the deprecated alias."""
    fields = getattr(type(out), "__dataclass_fields__", {})
    return getattr(out, "cache" if "cache" in fields else "past_key_values")
