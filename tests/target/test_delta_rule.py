"""A hybrid's short verifies run transformers' per-token Gated DeltaNet rule (target.delta_rule, docs/hybrid.md):
the routing engages on the verify and the replay, never on the prefill or outside the generator; it restores
the module's own function on exit and on an exception; it does nothing where the rule is not transformers'
torch reference (flash-linear-attention, a hub kernel's forward, a model off the CPU); greedy output stays
the target's own on every hybrid in tests/support/hybrids.py (tests/target/test_hybrid_exact.py's 300 tokens,
the rule's engagement counted there); and a router that drops the state or runs it one
token short fails the same checks."""
from __future__ import annotations

import functools
import math
import random

import pytest
import torch
from support.hybrids import make_tiny_hybrid
from support.infer_hybrid import hybrid_prompt, hybrid_target
from support.oracle import Oracle
from support.reference import hf_greedy

from draftsmith.infer import SpeculativeGenerator
from draftsmith.target import delta_rule, positions
from draftsmith.target.delta_rule import CHUNKED, PER_TOKEN, PER_TOKEN_MAX, SCAN, per_token_modules, per_token_rule
from draftsmith.target.cache_keywords import cache_kwargs, returned_cache
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.recurrent import LinearAttentionLayer

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

GDN = ("qwen3_5_text", "qwen3_next", "olmo_hybrid")  # the families whose layers run the Gated DeltaNet rules


def _module(model):
    (module,) = per_token_modules(model)
    return module


_LONG: dict = {}


def _long_memory(arch: str = "qwen3_5_text"):
    """A tiny Gated DeltaNet hybrid whose state decays slowly (A = 0.01, dt_bias 0: exp(g) ~ 0.99 per token):
    its greedy text depends on what the state held many tokens back, so a state dropped or one token short
    shows in the output (the random init, A up to 16, forgets within a few tokens)."""
    key = ("long-memory", arch)
    if key not in _LONG:
        model = make_tiny_hybrid(arch, seed=1, sharpen=4.0)
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            for layer in model.modules():
                if hasattr(layer, "A_log") and hasattr(layer, "dt_bias"):
                    layer.A_log.fill_(math.log(0.01))
                    layer.dt_bias.fill_(0.0)
        _LONG[key] = model
    return _LONG[key]


class Spy:
    """Counts which rule ran, on how many tokens, with or without a state, in which phase of the generator."""

    def __init__(self, monkeypatch, module, gen: SpeculativeGenerator | None = None) -> None:
        self.calls: list[tuple[str, str, int, bool]] = []  # (phase, rule, tokens, has state)
        self.phase = "outside"
        for name, rule in ((CHUNKED, "chunked"), (PER_TOKEN, "per-token")):
            monkeypatch.setattr(module, name, self._counting(getattr(module, name), rule))
        if gen is not None:
            for owner, method, phase in ((gen, "prefill", "prefill"), (gen, "_verify_rows", "verify"),
                                         (gen.rollback, "replay", "replay")):
                monkeypatch.setattr(owner, method, self._in_phase(getattr(owner, method), phase))

    def _counting(self, fn, rule):
        @functools.wraps(fn)
        def counted(query, *args, **kwargs):
            self.calls.append((self.phase, rule, query.shape[1], kwargs.get("initial_state") is not None))
            return fn(query, *args, **kwargs)
        return counted

    def _in_phase(self, fn, phase):
        def run(*args, **kwargs):
            outer, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = outer
        return run


@pytest.mark.parametrize("arch", GDN)
def test_short_verifies_run_the_per_token_rule_and_nothing_else_does(monkeypatch, arch):
    target = hybrid_target(arch)
    ids = hybrid_prompt(random.Random(5), 14)
    ref = hf_greedy(target, ids, 40)
    module = _module(target)
    gen = SpeculativeGenerator(target, Oracle(ref, right=3), rollback="merged")  # "recorded" runs its own loop
    spy = Spy(monkeypatch, module, gen)  # installed after the generator: its own rules, counted
    chunked = getattr(module, CHUNKED)
    assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)
    assert getattr(module, CHUNKED) is chunked  # restored after the decode
    verify = [(rule, n, state) for phase, rule, n, state in spy.calls if phase == "verify"]
    assert {("per-token", True)} == {(rule, state) for rule, n, state in verify if n <= PER_TOKEN_MAX}
    assert any(n > 1 for rule, n, _ in verify if rule == "per-token")  # multi-token verifies were routed
    assert all(rule == "chunked" and not state for phase, rule, _, state in spy.calls if phase == "prefill")
    # outside the generator a stateful multi-token forward keeps transformers' choice: the chunked rule
    spy.calls.clear()
    with torch.inference_mode():
        out = target(ids, use_cache=True)
        target(ids[:, :3], use_cache=True, **cache_kwargs(target, returned_cache(out)))
    assert ("outside", "chunked", 3, True) in spy.calls and all(rule == "chunked" for _, rule, _, _ in spy.calls)


def test_per_token_false_keeps_the_chunked_rule_everywhere(monkeypatch):
    """``per_token=False`` (what ``lab/bench_rollback.py --rules chunked`` times): no multi-token verify or
    replay is routed to the per-token rule, and the text is still the target's own."""
    target = hybrid_target("qwen3_5_text")
    ids = hybrid_prompt(random.Random(5), 14)
    ref = hf_greedy(target, ids, 40)
    gen = SpeculativeGenerator(target, Oracle(ref, right=3), rollback="replay", per_token=False)
    assert gen.per_token_modules == () and SpeculativeGenerator(target, NgramDrafter()).per_token_modules
    spy = Spy(monkeypatch, _module(target), gen)
    assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)
    assert any(phase == "replay" for phase, *_ in spy.calls)
    calls = [(rule, n) for phase, rule, n, _ in spy.calls if phase in ("verify", "replay")]
    # nothing routed: multi-token calls run the chunked rule (transformers itself runs one-token calls per token)
    assert all(rule == "chunked" for rule, n in calls if n > 1) and any(n > 1 for _, n in calls)


def test_replays_route_too_and_long_calls_stay_chunked(monkeypatch):
    """The replay (rollback="replay") is a short stateful forward as well; a verify longer than PER_TOKEN_MAX
    keeps the chunked rule."""
    target = hybrid_target("qwen3_5_text")
    ids = hybrid_prompt(random.Random(6), 14)
    ref = hf_greedy(target, ids, 40)
    module = _module(target)
    gen = SpeculativeGenerator(target, Oracle(ref, right=PER_TOKEN_MAX + 1), rollback="replay")
    spy = Spy(monkeypatch, module, gen)
    assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)
    assert any(phase == "replay" and rule == "per-token" and n > 1 for phase, rule, n, _ in spy.calls)
    assert any(phase == "verify" and rule == "chunked" and n > PER_TOKEN_MAX and state
               for phase, rule, n, state in spy.calls)


def test_the_context_restores_on_exit_on_an_exception_and_when_nested():
    target = hybrid_target("qwen3_5_text")
    module = _module(target)
    own = getattr(module, CHUNKED)
    with per_token_rule((module,)):
        routed = getattr(module, CHUNKED)
        assert routed.routes_short_calls
        with per_token_rule((module,)):  # nested (a replay inside a verify's context, another generator)
            assert getattr(module, CHUNKED) is routed
        assert getattr(module, CHUNKED) is routed  # the outer context still holds it
    assert getattr(module, CHUNKED) is own
    with pytest.raises(RuntimeError, match="boom"):
        with per_token_rule((module,)):
            raise RuntimeError("boom")
    assert getattr(module, CHUNKED) is own and not delta_rule._entered
    assert per_token_modules(target) == (module,)  # the modules are found again after the swap


def _as_transformers_wraps(fn, implementation):
    """``fn`` wrapped the way transformers' kernel fallback decorator wraps it, with ``implementation`` chosen
    (a flash-linear-attention function when that package is installed)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return implementation(*args, **kwargs)
    return wrapped


def test_nothing_routes_where_the_rule_is_not_the_torch_reference(monkeypatch):
    target = hybrid_target("qwen3_5_text")
    module = _module(target)
    def chunk_gated_delta_rule(*args, **kwargs):  # stands in for flash-linear-attention's kernel
        raise AssertionError("never called here")

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule"
    for name in (CHUNKED, PER_TOKEN):  # fla installed: transformers' decorator chose its kernel for either rule
        with monkeypatch.context() as m:
            m.setattr(module, name, _as_transformers_wraps(getattr(module, name).__wrapped__, chunk_gated_delta_rule))
            assert per_token_modules(target) == ()
            assert SpeculativeGenerator(target, NgramDrafter()).per_token_modules == ()
    # the decorator as transformers builds it, falling back to the reference: routed
    with monkeypatch.context() as m:
        reference = getattr(module, CHUNKED).__wrapped__
        m.setattr(module, CHUNKED, _as_transformers_wraps(reference, reference))
        assert per_token_modules(target) == (module,)
    # a hub kernel replaced the Gated DeltaNet layers' forward (kernels' kernelize binds it on the instance)
    layers = [m for m in target.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert layers
    try:
        for layer in layers:
            layer.forward = lambda *args, **kwargs: None
        assert per_token_modules(target) == ()
    finally:
        for layer in layers:
            del layer.forward
    assert per_token_modules(target) == (module,)
    # not on the CPU (the crossover was measured there only): the meta device stands in for a GPU
    assert per_token_modules(make_tiny_hybrid("qwen3_5_text").to("meta")) == ()
    # a family without Gated DeltaNet or Mamba-2 layers, or per-token mixers: nothing to route
    assert per_token_modules(hybrid_target("lfm2")) == ()


# Greedy output stays the target's own with the routing on every family, the per-token rule counted where the
# family has Gated DeltaNet layers: test_hybrid_exact.py's 300-token test (every drafter with the routing:
# test_infer_hybrid.py).


MAMBA2 = ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1")


@pytest.mark.parametrize("arch", MAMBA2)
def test_short_mamba2_scans_run_in_one_chunk_of_their_length(monkeypatch, arch):
    """A scan shorter than the layer's chunk (a verify, a replay, the prefill of a short prompt) runs with
    chunk_size = its length (no padding to the chunk: docs/hybrid.md); anything outside the generator keeps the
    layer's chunk size; the output stays the target's own."""
    target = hybrid_target(arch)
    ids = hybrid_prompt(random.Random(7), 14)
    ref = hf_greedy(target, ids, 32)
    (module,) = per_token_modules(target)
    calls = []  # (tokens, chunk_size, has state)
    scan = getattr(module, SCAN)

    def counted(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs):
        calls.append((hidden_states.shape[1], chunk_size, kwargs.get("initial_states") is not None))
        return scan(hidden_states, dt, A, B, C, chunk_size, *args, **kwargs)

    gen = SpeculativeGenerator(target, Oracle(ref, right=3), rollback="replay")
    monkeypatch.setattr(module, SCAN, counted)  # after the generator: transformers' own scan, counted
    assert torch.equal(gen.generate(ids, max_new_tokens=32), ref)
    chunk = target.config.get_text_config().mamba_chunk_size if hasattr(target.config, "mamba_chunk_size") else \
        target.config.chunk_size
    assert {n == size for n, size, state in calls if n > 1} == {True}
    assert any(not state for _, _, state in calls)  # the prefill's scan was counted
    assert getattr(module, SCAN) is counted  # its own function back after the decode
    calls.clear()
    target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2)
    assert calls and all(size == chunk for _, size, _ in calls)  # outside the generator: transformers' own chunk


# ------------------------------------------------------------------------------------- planted bugs

@functools.cache
def _long_refs(seeds=(2, 3, 4), max_new: int = 48) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(prompt, the long-memory target's own text) per seed, once per process (the planted router acts inside
    the generator only, never on ``generate``)."""
    target = _long_memory()
    return tuple((ids, hf_greedy(target, ids, max_new)) for ids in (hybrid_prompt(random.Random(s), 14) for s in seeds))


def _runs(target, rollback: str = "merged"):
    """(output, the target's own) for each prompt, with a partial accept at every step and with none, each decoded
    when asked for (``all`` stops at the first run that differs: a planted bug is caught there)."""
    for ids, ref in _long_refs():
        for drafter in (Oracle(ref, right=3), Oracle(ref, right=4, wrong=False)):
            gen = SpeculativeGenerator(target, drafter, rollback=rollback)
            yield gen.generate(ids, max_new_tokens=ref.shape[1] - ids.shape[1]), ref


@functools.cache
def _clean_long_runs_equal(rollback: str = "merged") -> bool:
    """The unplanted runs equal the target's own: once per process and rollback, shared by the planted routers
    (each still runs its planted decode itself)."""
    return all(torch.equal(out, ref) for out, ref in _runs(_long_memory(), rollback))


@pytest.mark.parametrize("bug", ["no initial state", "state one token short"])
def test_a_router_that_loses_the_state_is_caught(monkeypatch, bug):
    target = _long_memory()
    assert _clean_long_runs_equal()
    routed = delta_rule._routed

    def planted(module, chunked, max_tokens):
        rule = routed(module, chunked, max_tokens)
        per_token = getattr(module, PER_TOKEN)

        def buggy(query, key, value, g, beta, initial_state=None, **kwargs):
            if initial_state is None or query.shape[1] > max_tokens:
                return rule(query, key, value, g, beta, initial_state=initial_state, **kwargs)
            kwargs.pop("chunk_size", None)
            if bug == "no initial state":  # the layer's state dropped: every verify starts from zeros
                return per_token(query, key, value, g=g, beta=beta, **kwargs)
            out, _ = per_token(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)
            _, short = per_token(query[:, :-1], key[:, :-1], value[:, :-1], g=g[:, :-1], beta=beta[:, :-1],
                                 initial_state=initial_state, **kwargs)
            return out, short  # right outputs, the state after all but the last token

        buggy.routes_short_calls = True
        return buggy

    monkeypatch.setattr(delta_rule, "_routed", planted)
    assert not all(torch.equal(out, ref) for out, ref in _runs(target))


@pytest.mark.parametrize("bug", ["no initial state", "states one token late"])
def test_a_recording_rule_that_loses_the_state_is_caught(monkeypatch, bug):
    """rollback="recorded": the recording rule starts every verify from zeros, or hands the cache the states one
    token late (position t holds t + 1's; the outputs and the final state right)."""
    target = _long_memory()
    assert _clean_long_runs_equal("recorded")
    recording = positions.recurrent_gated_delta_rule

    def planted(query, key, value, g, beta, initial_state, *args):
        if bug == "no initial state":
            return recording(query, key, value, g, beta, torch.zeros_like(initial_state), *args)
        out, final, states = recording(query, key, value, g, beta, initial_state, *args)
        return out, final, torch.cat([states[:, 1:], states[:, -1:]], dim=1)

    monkeypatch.setattr(positions, "recurrent_gated_delta_rule", planted)
    assert not all(torch.equal(out, ref) for out, ref in _runs(target, "recorded"))


def test_a_short_scan_that_loses_the_state_is_caught(monkeypatch):
    """Planted bug: the short Mamba-2 scan drops the layer's state (every verify starts from zeros): merged decodes
    another text; recorded finds no per-position states for the call and stops."""
    target = hybrid_target("nemotron_h")
    ids = hybrid_prompt(random.Random(7), 14)
    ref = hf_greedy(target, ids, 32)
    assert torch.equal(SpeculativeGenerator(target, Oracle(ref, right=3)).generate(ids, max_new_tokens=32), ref)
    assert torch.equal(SpeculativeGenerator(target, Oracle(ref, right=3), rollback="merged").generate(
        ids, max_new_tokens=32), ref)
    short_scan = delta_rule._short_scan

    def planted(chunked):
        scan = short_scan(chunked)

        def stateless(*args, initial_states=None, **kwargs):
            return scan(*args, initial_states=None if args[0].shape[1] > 1 else initial_states, **kwargs)
        return stateless

    monkeypatch.setattr(delta_rule, "_short_scan", planted)
    gen = SpeculativeGenerator(target, Oracle(ref, right=3), rollback="merged")
    assert not torch.equal(gen.generate(ids, max_new_tokens=32), ref)
    with pytest.raises(RuntimeError, match="recurrent layer 0's rule kept no per-position states"):  # loud
        SpeculativeGenerator(target, Oracle(ref, right=3), rollback="recorded").generate(ids, max_new_tokens=32)
