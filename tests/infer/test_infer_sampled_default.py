"""Sampled decoding's defaults (issue 56): the one categorical draw every sampled step makes (``infer.accept.categorical``),
the CPU default chain's policy per sampling mode (``infer.drafters.free.by_temperature``), the chooser's probes,
the step that keeps only its root skipping the cache's compaction, and the static cache's kept per-layer views. Costs are given, never timed."""
from __future__ import annotations

import pytest
import torch
from support.accept import chi_square_pvalue
from support.chooser import CHEAP, STEEP, tiny_eagle3
from support.oracle import Oracle
from support.reference import hf_greedy

from draftsmith.infer import SpeculativeGenerator, cost_profile
from draftsmith.infer.accept import categorical
from draftsmith.infer.drafters import (AdaptiveLength, ByTemperature, Chain, CostAwareLength, Draft, Drafter, Sampling,
                                       chain_buffers, make_drafter, root_only)
from draftsmith.infer.drafters.free.chooser import best_length, step_table

TRIALS = 40_000
LONGEST = 16


class Ones(Drafter):
    """A chain drafter stub: drafts ``max_depth`` ones."""

    max_nodes = LONGEST + 1

    def new_rows(self, prompts, lengths):
        return [None] * len(prompts)

    def observe_rows(self, states, features, next_tokens):
        pass

    def propose_rows(self, states, roots, sampling, max_depths):
        return [Draft(torch.cat([r.reshape(1), torch.ones(d, dtype=torch.long)]), chain_buffers(d, r.device))
                for r, d in zip(roots, max_depths)]


def _lengths(chooser: CostAwareLength, accept, steps: int) -> list[int]:
    """``steps`` steps of one row; ``accept(k)`` drafts of each k-level draft kept. Returns the lengths drafted."""
    (state,) = chooser.new_rows([torch.ones(1, 4, dtype=torch.long)], [1000])
    lengths = []
    for _ in range(steps):
        (draft,) = chooser.propose_rows([state], [torch.tensor(1)], Sampling(), [1000])
        lengths.append(draft.tokens.shape[0] - 1)
        a = accept(lengths[-1])
        chooser.observe_rows([state], [torch.zeros(1, a + 1, 2)], [torch.ones(1, a + 1, dtype=torch.long)])
    return lengths


def test_categorical_draws_the_law_of_unnormalised_weights_and_never_a_zero():
    """Plants: searchsorted's right side (every draw one id up), no scaling by the row's sum (weights summing
    to 3 drawn as if they summed to 1), u in [0, 1) instead of (0, 1] are each caught here (the last: a leading
    zero weight drawn when u = 0, forced below)."""
    gen = torch.Generator().manual_seed(0)
    law = torch.tensor([0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 1.25, 0.0])  # sums to 3, zeros first, between and last
    draws = categorical(law.expand(TRIALS, -1), gen)
    counts = torch.bincount(draws, minlength=law.numel())
    assert counts[law == 0].sum() == 0
    assert chi_square_pvalue(counts[law > 0], law[law > 0] / law.sum()) > 1e-3
    assert categorical(law, gen).shape == ()  # one row: a 0-d id
    real = torch.rand
    try:  # u at its edge: a uniform draw of exactly 0 (u = 1) still lands on a nonzero weight
        torch.rand = lambda *a, **k: torch.zeros(*a[0], dtype=k.get("dtype"))
        assert int(categorical(law)) == 6  # u = 1: the last nonzero weight, never the zero after it
        torch.rand = lambda *a, **k: torch.full(a[0], 1 - 2**-53, dtype=k.get("dtype"))
        assert int(categorical(law)) == 1  # u just above 0: the first nonzero weight, never the leading zero
    finally:
        torch.rand = real


@pytest.fixture(scope="module")
def tiny():
    return tiny_eagle3()


def test_the_cpu_default_chain_adapts_greedy_and_chooses_sampled(tiny, tmp_path, monkeypatch):
    """An EAGLE head's default on CPU: greedy, the adaptive chain (every step drafts, the output is HF's); sampled,
    the chooser, which decodes plainly where drafting never pays (costs given: a verify costing a forward per token).
    Plants: ``ByTemperature.begin`` keeping the greedy policy, and the generator not calling ``begin``, both draft
    every sampled step but the last (which has no room left)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(cost_profile, "measure_curve", lambda gen, d, b, s: measured.append(s.greedy) or STEEP)
    target, head = tiny
    gen = SpeculativeGenerator(target, head)
    assert isinstance(gen.drafter, ByTemperature) and gen.drafter.greedy.drafter is gen.drafter.sampled.drafter
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(gen.generate(ids, max_new_tokens=12), hf_greedy(target, ids, 12))
    assert isinstance(gen.drafter.active, AdaptiveLength) and gen.last_stats.draft_budgets[0] == 1  # the last step
    assert measured == []  # greedy: no step costs needed
    gen.generate(ids, max_new_tokens=24, temperature=0.8)
    assert isinstance(gen.drafter.active, CostAwareLength) and measured == [False]
    assert gen.last_stats.draft_budgets.get(0, 0) >= 12  # after the prior's first drafts, plain decoding
    gen.generate(ids, max_new_tokens=12)
    assert isinstance(gen.drafter.active, AdaptiveLength) and gen.last_stats.draft_budgets[0] == 1


def test_a_greedy_batch_is_the_choosers_and_each_row_stays_hfs(tiny, tmp_path, monkeypatch):
    """Several greedy rows: the chooser drafts (a batch's verify carries every row's chain; with STEEP costs it decodes
    plainly after its first probes), each row the target's own greedy continuation; one row again: the adaptive
    chain. Plant: ``new_rows`` keeping the greedy policy for a batch (every step drafts, no cost asked for)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(cost_profile, "measure_curve", lambda gen, d, b, s: measured.append((b, s.greedy)) or STEEP)
    target, head = tiny
    gen = SpeculativeGenerator(target, head)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    out = gen.generate(ids, max_new_tokens=24)
    for row in range(3):
        assert torch.equal(out[row], hf_greedy(target, ids[row: row + 1], 24)[0])
    assert isinstance(gen.drafter.active, CostAwareLength) and measured == [(3, True)]
    assert gen.last_stats.draft_budgets.get(0, 0) >= 3 * 12
    gen.generate(ids[:1], max_new_tokens=12)
    assert isinstance(gen.drafter.active, AdaptiveLength) and gen.last_stats.draft_budgets[0] == 1


def test_by_temperature_refuses_two_drafters_and_a_decode_it_did_not_begin(tiny):
    target, head = tiny
    one, other = make_drafter(head, target, Chain(3)), make_drafter(head, target, Chain(3))
    with pytest.raises(ValueError, match="two wrappers of one drafter"):
        ByTemperature(AdaptiveLength(one), CostAwareLength(other, costs=CHEAP))
    with pytest.raises(TypeError, match="must be a drafter"):
        ByTemperature(AdaptiveLength(one), "chooser")
    drafter = ByTemperature(AdaptiveLength(one), CostAwareLength(one, costs=CHEAP))
    drafter.begin(Sampling())
    states = drafter.new_rows([torch.tensor([[5, 6]])], [20])
    with pytest.raises(ValueError, match="began a greedy decode but is asked for a draft at temperature 0.5"):
        drafter.propose_rows(states, [torch.tensor(7)], Sampling(0.5), [4])


def test_a_probe_that_hits_where_drafting_does_not_pay_still_doubles_the_wait():
    """Sampled drafts kept half the time, each level costing a token's forward (``STEEP``): drafting never pays, so
    the probes' waits double though half of them hit (plant: a hit starting the waits over, as before issue 56:
    a probe every 4 steps). A chain the chooser drafts by choice starts them over (the chooser's own test)."""
    hits = iter([1, 0] * 100)
    lengths = _lengths(CostAwareLength(Ones(), LONGEST, STEEP, probe_every=4), lambda k: next(hits) if k else 0, 70)
    probes = [i for i, k in enumerate(lengths) if k]
    assert [b - a for a, b in zip(probes, probes[1:])] == [9, 17, 33]


def test_the_step_table_is_the_curve():
    """``best_length`` reads the curve's seconds once per curve (plant: a table one length short raises, one
    shifted by a length changes the choices below)."""
    for costs in (CHEAP, STEEP):
        assert step_table(costs, LONGEST) == tuple(costs.step_seconds(k) for k in range(LONGEST + 1))
    assert best_length([0.7] * LONGEST, STEEP, LONGEST) == 0 and 1 <= best_length([0.7] * LONGEST, CHEAP, LONGEST) <= 6


def test_a_step_that_keeps_its_root_alone_skips_the_compaction_and_trees_still_compact(tiny):
    """A fork (a wrong sibling first, then the right token and its child: the kept nodes are not where a chain's
    would be) and a draft of the root alone, greedy: HF's output either way. Plants: compacting only when more
    than 3 nodes are kept, or never, both break the fork's output; the root-only steps must not need it."""
    target, _ = tiny
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = hf_greedy(target, ids, 16)
    gen = SpeculativeGenerator(target, Oracle([ref[0]], shape="fork"))
    assert torch.equal(gen.generate(ids, max_new_tokens=16), ref)
    assert gen.last_stats.tau > 2.5  # the fork's right branch kept at most steps

    class RootOnly(Oracle):
        def propose_rows(self, states, roots, sampling, max_depths):
            return [root_only(r) for r in roots]

    gen = SpeculativeGenerator(target, RootOnly([ref[0]], shape="chain"))
    assert torch.equal(gen.generate(ids, max_new_tokens=16), ref) and gen.last_stats.steps == 15


def test_the_cache_writes_each_layer_into_its_buffer_after_it_grows():
    """The static cache keeps each layer's views of its buffer (a one-token step's writes then index nothing but
    their slots). Plant: the views kept from the buffer before ``grow`` (writes after it land in the old one)."""
    from draftsmith.infer.cache import StaticKVCache

    cache = StaticKVCache(2, 4)
    k, v = torch.randn(1, 1, 2, 3), torch.randn(1, 1, 2, 3)
    cache.slots = torch.tensor([0, 1])
    for layer in (0, 1):
        cache.update(k, v, layer)
    cache.grow(8)
    cache.slots = torch.tensor([[5, 6]])  # one row's (B, T) slots
    keys, values = cache.update(2 * k, 3 * v, 1)
    assert keys.shape[2] == 8 and torch.equal(keys[:, :, 5:7], 2 * k) and torch.equal(values[:, :, 5:7], 3 * v)
    assert torch.equal(cache.buffer[1, 0, :, :, 5:7], 2 * k) and torch.equal(cache.buffer[1, 1, :, :, :2], v)
