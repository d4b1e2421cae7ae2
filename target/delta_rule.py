"""Which of transformers' two Gated DeltaNet rules a short verify runs (docs/hybrid.md, "Short verifies run the per-token
Gated DeltaNet rule").

transformers' Gated DeltaNet layers (Qwen3.5 / 3.6, Qwen3-Next, OLMo-hybrid) run one of two module-level
functions: ``torch_recurrent_gated_delta_rule`` (a loop over tokens: what plain decoding runs, one token
per call) when the forward has one token and a state, ``torch_chunk_gated_delta_rule`` otherwise. The
chunked rule's torch reference pads the sequence to a 64-token chunk and solves two 64 x 64 triangular
systems per head, so on CPU a verify of 2..12 tokens costs about what 64 would, where the per-token loop
costs in proportion to the tokens (measured in docs/hybrid.md: per call, the per-token rule is faster up to
11-12 tokens on ``demo:tiny-hybrid``'s layers, past 16 on wider layers and batches).

``per_token_rule(modules)`` is a context entered around the generator's verify and replay forwards: inside
it, those modules' ``torch_chunk_gated_delta_rule`` name routes a call with a state (``initial_state``) and at
most ``PER_TOKEN_MAX`` tokens to the same module's ``torch_recurrent_gated_delta_rule``, with the same
arguments; on exit (or an exception) the module's own function is back. Both are transformers' functions:
nothing of the model is re-implemented, and the per-token rule is the one plain decoding runs.

Inside ``target.positions.recording()`` (a verify whose rollback is "recorded") both routers keep the state after
every token: a stateful Gated DeltaNet call of any length runs ``positions.recurrent_gated_delta_rule``
(transformers' per-token rule with every state kept, bit for bit its outputs), a stateful Mamba-2 scan runs
``positions.mamba2_scan``; each ``put``s the states for the cache (``records_positions`` says where that covers
every recurrent layer).

``per_token_modules(model)`` picks the modules it applies to: only where both functions are transformers'
torch reference (never when flash-linear-attention or a hub kernel provides them: their chunked kernels
have no 64-token padding to avoid), the layer runs its class's own ``forward`` (a hub kernel may replace
it), and the model sits on the CPU (the only device the crossover was measured on).

Why a context and not a permanent patch: the swap lives only as long as our verify forward, so anything
else in the process calling the same model class (its ``generate``, training, another library) runs
transformers' code unchanged. A swap is process-wide while it lasts; a forward of another model of the same
class in another thread during our verify would also route, which only changes which of two exact
algorithms computes the same function. Nested and concurrent contexts count entries per module and
restore the original when the last one leaves.
"""
from __future__ import annotations

import inspect
import sys
import threading
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType

from torch import nn

from draftsmith.target import positions
from draftsmith.target.recurrent import LAYER_KINDS, model_type
from draftsmith.target.one_token import NO_LIMIT, clamped_mixers, one_token_mixers, one_token_steps

CHUNKED = "torch_chunk_gated_delta_rule"  # transformers' name in every Gated DeltaNet modeling file (5.17 and 5.24)
PER_TOKEN = "torch_recurrent_gated_delta_rule"
SCAN = "mamba2_chunk_scan"  # transformers 5.24's Mamba-2 chunked scan (Nemotron-H, Bamba, Granite-4-H, Falcon-H1, Zamba2)
# Most tokens a stateful call routes to the per-token rule: the kernel-level crossover on demo:tiny-hybrid's
# layers (CPU, one thread, batch 1: 11-12 tokens; wider heads and batches favour the per-token rule further).
PER_TOKEN_MAX = 12

_lock = threading.Lock()
_entered: dict[tuple[str, str], list] = {}  # (module name, function name) -> [its own function, entries]


def _is_torch_reference(fn) -> bool:
    """Whether ``fn`` (a module-level rule, wrapped by transformers' kernel fallback decorator) runs the torch
    reference: the decorator keeps the implementation it chose (fla's when installed) in its closure."""
    reference = inspect.unwrap(fn)
    try:
        chosen = inspect.getclosurevars(fn).nonlocals.get("implementation", reference)
    except (TypeError, ValueError):  # not a Python function: a kernel object, not the torch reference
        return False
    return chosen is reference and reference.__module__.startswith("transformers.")


def per_token_modules(model: nn.Module, gated_delta_rule: bool = True) -> tuple:
    """What a verify of ``model`` routes (empty: nothing): the modeling modules whose Gated DeltaNet or Mamba-2
    layers run transformers' torch reference of their rules, through their class's own ``forward``, on the CPU;
    the mixers of the families whose multi-token path is not their one-token decode, which run per token on
    every device (``target.one_token``); and the Mamba-2 mixers that clamp dt in their chunked path only
    (Nemotron-H) where their scan is not routed here (another device, a kernel): per token too.

    ``gated_delta_rule=False`` leaves the Gated DeltaNet modules out (their chunked rule runs: the same function,
    so exactness keeps) and keeps everything exactness needs: the mixers run per token, the Mamba-2 scans
    without the clamp."""
    rules = _rule_modules(model)
    scanned = {m.__name__ for m in rules if not hasattr(m, CHUNKED)}  # Mamba-2 modules: their scan drops the clamp
    mixers = one_token_mixers(model)
    mixers += tuple(m for m in clamped_mixers(model) if type(m).__module__ not in scanned and m not in mixers)
    if not gated_delta_rule:
        rules = tuple(m for m in rules if not hasattr(m, CHUNKED))
    return rules + mixers


def records_positions(model: nn.Module, routes: tuple) -> bool:
    """Whether a verify of ``model`` under ``routes`` (``per_token_modules``) keeps every position's states
    (``target.positions``): its conv windows always do; its recurrent matrices where its family's rule is routed
    here (Gated DeltaNet's, Mamba-2's scan), not where mixers run per token or keep no state routed here."""
    if any(isinstance(r, nn.Module) for r in routes):
        return False  # mixers stepped one token at a time (Jamba, Zamba, a clamping Mamba-2 off the CPU)
    kind = LAYER_KINDS.get(model_type(model))
    routed = {name for name in (CHUNKED, SCAN) for m in routes if hasattr(m, name)}
    return (kind == "short conv" or (kind == "Gated DeltaNet" and CHUNKED in routed)
            or (kind == "Mamba-2" and SCAN in routed))


def _calls(cls: type, name: str) -> bool:
    """Whether a function of ``cls`` (its ``forward`` or a helper it dispatches to) calls ``name``."""
    for value in vars(cls).values():
        code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
        if code is not None and name in code.co_names:
            return True
    return False


def _rule_modules(model: nn.Module) -> tuple[ModuleType, ...]:
    """The modeling modules of ``model``'s Gated DeltaNet and Mamba-2 layers whose rules are transformers'
    torch reference, called by the class's own ``forward``, on the CPU."""
    modules: dict[str, ModuleType] = {}
    for layer in model.modules():
        module = sys.modules.get(type(layer).__module__)
        own = type(layer).forward
        names = [name for name in (CHUNKED, SCAN) if _calls(type(layer), name)]
        if not names:
            continue  # not a Gated DeltaNet or Mamba-2 layer: it never calls a chunked rule
        forward = vars(layer).get("_old_forward", vars(layer).get("forward", own))  # accelerate keeps the class's
        if getattr(forward, "__func__", forward) is not own:  # a hub kernel's forward replaced the class's
            continue
        rules = [_own(module, names[0])] + ([getattr(module, PER_TOKEN, None)] if names[0] == CHUNKED else [])
        if not all(_is_torch_reference(rule) for rule in rules):
            continue
        if any(p.device.type != "cpu" for p in layer.parameters(recurse=False)):
            continue
        modules[module.__name__] = module
    return tuple(modules.values())


def _own(module: ModuleType, name: str):
    """``module``'s own function ``name`` (not a router a context bound in its place)."""
    entry = _entered.get((module.__name__, name))
    return entry[0] if entry is not None else getattr(module, name)


def _short_scan(chunked):
    """Mamba-2's chunked scan, run over a stateful call (a verify or a replay) as the one-token update computes it:
    without the dt clamp (``dt_limit``: Nemotron-H's and Zamba2's mixers pass (``time_step_min``, inf) to the
    chunked scan only; ``mamba2_selective_state_update``, what ``generate`` runs per token, clamps nothing), and
    over T < ``chunk_size`` tokens in one chunk of T (the same function: the chunked algorithm is exact for any
    chunk length) without padding T to the chunk. A call without a state (the prefill, ``prefill_rule``) keeps its
    clamp and runs in one chunk of T too when T < ``chunk_size``: a 128-token prompt no longer pays for 256."""

    def scan(hidden_states, dt, A, B, C, chunk_size: int, *args, initial_states=None, **kwargs):
        if initial_states is not None:
            kwargs["dt_limit"] = NO_LIMIT
        chunk_size = min(chunk_size, hidden_states.shape[1])
        if initial_states is not None and positions.on() and kwargs.get("return_final_states") and not args:
            out, final, states = positions.mamba2_scan(  # a recorded verify: every position's state kept
                hidden_states, dt, A, B, C, initial_states, kwargs.get("D"), kwargs.get("dt_bias"),
                kwargs.get("dt_softplus", False), NO_LIMIT)
            positions.put(final, states)
            return out, final
        return chunked(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=initial_states, **kwargs)

    scan.routes_short_calls = True
    return scan


def _routed(module: ModuleType, chunked, max_tokens: int):
    """``module``'s chunked rule, sending a call with a state and at most ``max_tokens`` tokens to the
    module's per-token rule (looked up per call). query (B, T, H_k, d_k); initial_state (B, H_v, d_k, d_v)."""

    def rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None, output_final_state: bool = False,
             use_qk_l2norm_in_kernel: bool = False, **kwargs):
        if initial_state is not None and output_final_state and positions.on():  # a verify keeping every state
            out, final, states = positions.recurrent_gated_delta_rule(query, key, value, g, beta, initial_state,
                                                                      use_qk_l2norm_in_kernel)
            positions.put(final, states)
            return out, final
        if initial_state is not None and query.shape[1] <= max_tokens:
            return getattr(module, PER_TOKEN)(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                              output_final_state=output_final_state,
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        return chunked(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

    rule.routes_short_calls = True  # marks the swap (tests look for it)
    return rule


@contextmanager
def per_token_rule(routes: tuple, max_tokens: int = PER_TOKEN_MAX):
    """Inside: the modeling modules in ``routes`` run their chunked Gated DeltaNet rule's stateful calls of at
    most ``max_tokens`` tokens with the per-token rule, and their Mamba-2 scan's stateful calls shorter than a
    chunk in one chunk of their length; the mixers in it run stateful calls one token at a time
    (``target.one_token``). On exit each has its own function back (when no other context holds it)."""
    modules = tuple(r for r in routes if isinstance(r, ModuleType))
    with one_token_steps(tuple(r for r in routes if isinstance(r, nn.Module))), _swapped(modules, max_tokens):
        yield


def prefill_rule(routes: tuple) -> AbstractContextManager:
    """The context of the generator's prefill: of ``routes`` (``per_token_modules``), only the Mamba-2 scans are
    routed (``_short_scan``: a prompt shorter than the layer's chunk runs in one chunk of its length). Nothing else
    changes there: the Gated DeltaNet rules route stateful calls only, and mixers stepped one token at a time
    (``target.one_token``) are left to their own prefill."""
    return _swapped(tuple(r for r in routes if isinstance(r, ModuleType) and not hasattr(r, CHUNKED)), PER_TOKEN_MAX)


@contextmanager
def _swapped(modules: tuple[ModuleType, ...], max_tokens: int):
    """Each module's chunked rule bound to its router (Gated DeltaNet: ``_routed``; Mamba-2: ``_short_scan``)."""
    swaps = [(m, CHUNKED if hasattr(m, CHUNKED) else SCAN) for m in modules]
    with _lock:
        for module, name in swaps:
            entry = _entered.setdefault((module.__name__, name), [getattr(module, name), 0])
            if entry[1] == 0:
                router = _routed(module, entry[0], max_tokens) if name == CHUNKED else _short_scan(entry[0])
                setattr(module, name, router)
            entry[1] += 1
    try:
        yield
    finally:
        with _lock:
            for module, name in swaps:
                entry = _entered[(module.__name__, name)]
                entry[1] -= 1
                if entry[1] == 0:
                    setattr(module, name, entry[0])
                    del _entered[(module.__name__, name)]


__all__ = ["PER_TOKEN_MAX", "per_token_modules", "per_token_rule", "prefill_rule", "records_positions"]
