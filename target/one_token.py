"""Jamba's and Zamba's Mamba layers verify a draft one token at a time, and so does a Mamba-2 mixer that clamps
dt where its scan cannot be routed: what the target's own decode computes (docs/hybrid.md, "Exact against the
target's own decode").

Greedy speculative decoding is lossless when a verify over N drafted tokens computes what the target's own
``generate`` computes one token at a time. transformers' Mamba mixers do not: their forward over several
tokens with a state (a verify) runs another function than over one token (a decode step):
- Jamba's and Zamba's Mamba-1 mixers run ``mamba_selective_scan`` from a zero state whenever the forward has
  several tokens: the state the cache holds is ignored (max logit difference 3.2 on tests/support/hybrids.py's
  Jamba, argmax agreeing at 1 of 24 positions);
- Nemotron-H's and Zamba2's Mamba-2 mixers clamp dt at ``time_step_min`` (``time_step_limit``) in their
  chunked scan and not in their one-token update (``mamba2_selective_state_update`` takes no limit): in
  float64 with the clamp dropped and the scan's float32 casts removed, the multi-token path equals the
  one-token steps to 4e-16; with the clamp, 3e-3 (docs/hybrid.md). ``target.delta_rule`` drops the clamp on
  stateful scans where it routes the scan (transformers' torch reference on the CPU); elsewhere those mixers
  (``clamped_mixers``) run per token here. Bamba, Granite-4.0-H and Falcon-H1 clamp nothing by default
  (``time_step_limit`` (0, inf)) and compute the same function up to rounding.

``one_token_steps(mixers)`` is a context the generator enters around each verify and replay forward
(through ``target.delta_rule.per_token_rule``, whose routes ``per_token_modules`` lists these mixers with the
Gated DeltaNet modules): inside it, each mixer's forward over T > 1 tokens with a state in the cache runs
as T calls of the mixer's own forward over one token each (its one-token branch: ``causal_conv1d_update``
and the selective state update, exactly what a decode step runs), their outputs concatenated. Only the
mixers (their projections included) run per token; attention and MLPs still run the verify as one [B, N]
forward. Nothing of the model is re-implemented: the swap binds the instance's ``forward``
(not the class's: any other model of the class is untouched) and is undone on exit, or an exception.
A forward without a state (the prefill, training) is passed through as it is.
"""
from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager

import torch
from torch import nn

from draftsmith.target.recurrent import model_type

# Families whose multi-token cached forward is not their one-token decode (measured in docs/hybrid.md;
# tests/target/test_hybrid_exact.py checks every family against this list)
ONE_TOKEN_FAMILIES = ("jamba", "zamba")
NO_LIMIT = (0.0, float("inf"))  # a Mamba-2 dt_limit that clamps nothing (softplus is positive)
_CACHE_CALLS = frozenset({"get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state"})

_lock = threading.Lock()
_entered: dict[int, list] = {}  # id(mixer) -> [the forward it had ("" when none of its own), entries]


def _is_mixer(module: nn.Module) -> bool:
    """Whether ``module``'s class reads or writes a recurrent layer's states itself (a mixer)."""
    for value in vars(type(module)).values():
        code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
        if code is not None and _CACHE_CALLS & set(code.co_names):
            return True
    return False


def one_token_mixers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The recurrent mixers of ``model`` that a verify runs per token (empty: not one of those families)."""
    if model_type(model) not in ONE_TOKEN_FAMILIES:
        return ()
    return tuple(m for m in model.modules() if _is_mixer(m) and hasattr(m, "layer_idx"))


def clamped_mixers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The Mamba-2 mixers of ``model`` whose chunked path clamps dt (``time_step_limit`` other than (0, inf):
    Nemotron-H's and Zamba2's clamp it at ``time_step_min``) where their one-token update does not: a stateful
    chunked scan computes another function than ``generate``'s one-token steps unless the clamp is dropped
    (``target.delta_rule``) or the mixer runs per token."""
    return tuple(m for m in model.modules() if _is_mixer(m) and hasattr(m, "layer_idx")
                 and tuple(getattr(m, "time_step_limit", None) or NO_LIMIT) != NO_LIMIT)


def _has_state(cache, layer_idx: int) -> bool:
    return cache is not None and (cache.get_recurrent_state(layer_idx) is not None
                                  or cache.get_conv_state(layer_idx) is not None)


def _column(value, t: int, length: int):
    """Token ``t`` of a per-token argument (B, T, ...) or a tuple of them; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
        return value[:, t: t + 1]
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_column(v, t, length) for v in value)
    return value


def _stepped(mixer: nn.Module, forward):
    """``forward`` (the mixer's own) run token by token when a call has several tokens and a state."""

    def step_by_step(*args, **kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cache = args[1] if len(args) > 1 else kwargs.get("cache", kwargs.get("cache_params"))
        length = hidden.shape[1]
        if length == 1 or not _has_state(cache, mixer.layer_idx):
            return forward(*args, **kwargs)
        outs = [forward(*[_column(a, t, length) for a in args], **{k: _column(v, t, length) for k, v in kwargs.items()})
                for t in range(length)]
        return torch.cat(outs, dim=1)

    step_by_step.runs_one_token = True  # marks the swap (tests look for it)
    return step_by_step


@contextmanager
def one_token_steps(mixers: tuple[nn.Module, ...]):
    """Inside: each of ``mixers`` runs a stateful forward over several tokens one token at a time; on exit
    each has its own forward back (when no other context holds it)."""
    with _lock:
        for mixer in mixers:
            entry = _entered.setdefault(id(mixer), [vars(mixer).get("forward", ""), 0])
            if entry[1] == 0:
                mixer.forward = _stepped(mixer, mixer.forward)
            entry[1] += 1
    try:
        yield
    finally:
        with _lock:
            for mixer in mixers:
                entry = _entered[id(mixer)]
                entry[1] -= 1
                if entry[1] == 0:
                    if entry[0] == "":
                        del mixer.forward
                    else:
                        mixer.forward = entry[0]
                    del _entered[id(mixer)]


__all__ = ["NO_LIMIT", "ONE_TOKEN_FAMILIES", "clamped_mixers", "one_token_mixers", "one_token_steps"]
