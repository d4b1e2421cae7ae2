"""The draft-length chooser (``infer.drafters.free.chooser``) and the step costs it reads (``infer.cost_model``,
``infer.cost_profile``). Costs are given here, never timed: the profile's measurement is replaced where it would
run, except in the one test that checks it leaves torch's random state as it was."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.chooser import CHEAP, FLAT, STEEP, tiny_eagle3

from draftsmith.heads import build_head
from draftsmith.infer import DynamicTree, SpeculativeGenerator, StaticTree
from draftsmith.infer import cost_profile
from draftsmith.infer.cost_model import PROBE_IDLE, StepCosts, load_costs
from draftsmith.infer.drafters import Chain, Draft, Drafter, Sampling, chain_buffers, chosen_chain, chosen_tree
from draftsmith.infer.tree import tree_from_parents
from draftsmith.infer.drafters.free.chooser import (CostAwareLength, acceptance, batch_length, best_length,
                                                   first_wait)

LONGEST = 16


def test_no_acceptance_decodes_plainly_full_acceptance_drafts_the_longest():
    """With cheap drafts: acceptance ~0 gives 0 (plain decoding), ~1 the longest chain."""
    assert best_length([0.005] * LONGEST, FLAT, LONGEST) == 0
    assert best_length([0.005] * LONGEST, CHEAP, LONGEST) == 0
    assert best_length([0.999] * LONGEST, FLAT, LONGEST) == LONGEST
    assert best_length([0.999] * LONGEST, CHEAP, LONGEST) == LONGEST
    assert best_length([0.999] * LONGEST, FLAT, 5) == 5  # never past the row's budget


def test_the_verify_cost_shortens_the_draft():
    """Plant (the chooser ignoring the verify's cost: the step's seconds without ``verify``, plus t(1)): a steep
    t(N) would then draft long chains at 70% acceptance; the expected tokens never pay N tokens' forward."""
    p = [0.7] * LONGEST
    assert best_length(p, FLAT, LONGEST) >= 6
    assert best_length(p, STEEP, LONGEST) == 0
    assert 1 <= best_length(p, CHEAP, LONGEST) <= 6


def test_acceptance_estimates_each_depth_from_the_one_before():
    """A depth never reached starts from the depth before it as far as that depth's tries vouch for it, the prior
    otherwise; counts pull it to what was seen. One hit at depth 1 is not read as 0.8 at every depth (a 16-row batch
    drafted chains of 10 and more after one probe); ten straight hits carry on to the next depth."""
    assert acceptance([0.0, 0.0], [0.0, 0.0], 0.6) == [0.6, 0.6]
    assert acceptance([1.0, 0.0, 0.0], [1.0, 0.0, 0.0], 0.6) == pytest.approx([0.8, 0.7, 0.6])
    p = acceptance([9.0, 0.0, 0.0], [9.0, 9.0, 0.0], 0.6)
    start = (9 * 0.96 + 0.6) / 10
    assert p[0] == pytest.approx(9.6 / 10) and p[1] == pytest.approx(start / 10)
    assert p[2] == pytest.approx((9 * p[1] + 0.6) / 10)
    assert acceptance([10.0, 0.0], [10.0, 0.0], 0.6)[1] == pytest.approx((10 * 10.6 / 11 + 0.6) / 11)


class Recorder(Drafter):
    """A chain drafter stub: drafts ``max_depth`` ones; records each observe's token counts."""

    max_nodes = LONGEST + 1

    def __init__(self):
        self.observed: list[list[int]] = []

    def new_rows(self, prompts, lengths):
        return [None] * len(prompts)

    def observe_rows(self, states, features, next_tokens):
        self.observed.append([t.shape[1] for t in next_tokens])

    def propose_rows(self, states, roots, sampling, max_depths):
        return [Draft(torch.cat([r.reshape(1), torch.ones(d, dtype=torch.long)]), chain_buffers(d, r.device))
                for r, d in zip(roots, max_depths)]


def _run(chooser: CostAwareLength, accept, steps: int, left: int | None = None,
         sampling: Sampling = Sampling()) -> list[int]:
    """``steps`` steps of one row; ``accept(k)`` drafts of each k-level draft accepted. Returns the lengths drafted.
    ``left``: the tokens the row may still emit at the first step (None: always 1000), one fewer each step."""
    chooser.begin(sampling)
    (state,) = chooser.new_rows([torch.ones(1, 4, dtype=torch.long)], [1000])
    chooser.observe_rows([state], [torch.zeros(1, 4, 2)], [torch.ones(1, 4, dtype=torch.long)])
    lengths = []
    for step in range(steps):
        depth = 1000 if left is None else left - step - 1
        (draft,) = chooser.propose_rows([state], [torch.tensor(1)], sampling, [depth])
        k = draft.tokens.shape[0] - 1
        lengths.append(k)
        a = accept(k)
        chooser.observe_rows([state], [torch.zeros(1, a + 1, 2)], [torch.ones(1, a + 1, dtype=torch.long)])
    return lengths


def test_the_chooser_learns_each_rows_acceptance_online():
    """Every draft accepted: the chain grows, never shorter, to the longest. None accepted: the row stops drafting, probes one
    level after ``probe_every`` steps at 0, then after twice as many each time a probe misses, and observes the
    waiting tokens in one call before it drafts again. A probe accepted starts drafting again."""
    grown = _run(CostAwareLength(Recorder(), LONGEST, CHEAP), lambda k: k, 24)
    assert grown[-5:] == [LONGEST] * 5 and all(b >= a for a, b in zip(grown, grown[1:]))  # deeper as it learns
    inner = Recorder()
    lengths = _run(CostAwareLength(inner, LONGEST, CHEAP, probe_every=4), lambda k: 0, 60)
    assert lengths[0] > 1  # the prior: a new row drafts
    first = lengths.index(0)
    assert set(lengths[first:]) == {0, 1}
    probes = [i for i in range(first, len(lengths)) if lengths[i]]
    assert [b - a for a, b in zip(probes, probes[1:])] == [9, 17] and probes[0] - first == 4  # waits 4, 8, 16
    assert inner.observed[-1] == [17]  # the last probe observed at once the last 16 steps' tokens and its own
    steps = iter(range(1000))
    lengths = _run(CostAwareLength(Recorder(), LONGEST, CHEAP, probe_every=4), lambda k: k if next(steps) >= 40 else 0,
                   90)
    assert lengths[30:40].count(0) >= 8 and lengths[-1] == LONGEST  # text it can predict again: it drafts again


def test_a_sampled_probe_waits_as_long_as_it_costs_and_only_where_tokens_are_left_to_use_it():
    """Sampled, a probe step adding 1.01 plain steps' seconds (``STEEP``, its probe not measured: a one-level step)
    waits ceil(1.01 / ``PROBE_SHARE``) = 21 steps at 0, then twice as many (plant: every probe after ``probe_every``,
    as greedy: a probe after 4 steps); one adding 0.12 (``CHEAP``) waits ``probe_every``, the floor; a measured probe
    its own cost. A row with fewer tokens left than the wait probes no more (plant: the tokens left ignored: a probe
    at step 21 of a row emitting 30). Greedy, the first wait is ``probe_every`` (its misses carry, next test)."""
    never, hot = (lambda k: 0), Sampling(1.0)  # noqa: E731
    steep = CostAwareLength(Recorder(), LONGEST, STEEP, probe_every=4)
    lengths = _run(steep, never, 120, sampling=hot)
    assert [i for i, k in enumerate(lengths) if k] == [21, 21 + 43]
    assert first_wait(STEEP, 4, greedy=False) == 21 and first_wait(CHEAP, 4, greedy=False) == 4
    assert first_wait(dataclasses.replace(STEEP, probe=3.01), 4, greedy=False) == 41  # measured: 2.01 plain steps more
    short = _run(CostAwareLength(Recorder(), LONGEST, STEEP, probe_every=4), never, 30, left=30, sampling=hot)
    assert short == [0] * 30
    lengths = _run(CostAwareLength(Recorder(), LONGEST, STEEP, probe_every=4), never, 50, left=42, sampling=hot)
    assert [i for i, k in enumerate(lengths) if k] == [21]  # 21 tokens left then: the probe's wait is 21
    greedy = CostAwareLength(Recorder(), LONGEST, STEEP, probe_every=4)
    assert [i for i, k in enumerate(_run(greedy, never, 40)) if k] == [4, 4 + 9, 4 + 9 + 17]


def test_a_batch_drafts_one_length_for_the_sum_of_its_rows():
    """The rows' expected tokens summed: one row that drafts well and three that do not draft nothing together
    under steep costs, the longest under flat ones; a row's budget caps what it adds; one row is ``best_length``."""
    good, bad = [0.99] * LONGEST, [0.05] * LONGEST
    assert batch_length([good], [LONGEST], CHEAP, LONGEST) == best_length(good, CHEAP, LONGEST) == LONGEST
    assert batch_length([good, bad, bad, bad], [LONGEST] * 4, STEEP, LONGEST) == 0
    assert batch_length([good, bad, bad, bad], [LONGEST] * 4, FLAT, LONGEST) == LONGEST
    assert batch_length([good, good], [2, 2], FLAT, LONGEST) == 2  # nothing past the budgets pays
    assert batch_length([[0.99] * 3, [0.99] * 3], [LONGEST, LONGEST], FLAT, LONGEST) == 3  # nor past the estimates


def test_every_row_of_a_batch_drafts_the_same_length_cut_to_its_budget():
    """Two rows, one whose drafts are all kept and one whose drafts never are: one length for both (plant: each row
    its own best length, the first drafting long while the second decodes plainly), the second cut to its room; the
    profile's forced length the same way."""
    chooser = CostAwareLength(Recorder(), LONGEST, CHEAP)
    states = chooser.new_rows([torch.ones(1, 4, dtype=torch.long)] * 2, [1000, 1000])
    for _ in range(12):
        drafts = chooser.propose_rows(states, [torch.tensor(1)] * 2, Sampling(), [1000, 1000])
        lengths = [d.tokens.shape[0] - 1 for d in drafts]
        assert lengths[0] == lengths[1]
        chooser.observe_rows(states, [torch.zeros(1, k + 1, 2) for k in (lengths[0], 0)],
                             [torch.ones(1, lengths[0] + 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)])
    assert lengths[0] > 0  # the first row's acceptance carries the pair
    drafts = chooser.propose_rows(states, [torch.tensor(1)] * 2, Sampling(), [1000, 2])
    assert [d.tokens.shape[0] - 1 for d in drafts] == [lengths[0], min(lengths[0], 2)]
    chooser.forced = 5
    drafts = chooser.propose_rows(states, [torch.tensor(1)] * 2, Sampling(), [1000, 3])
    assert [d.tokens.shape[0] - 1 for d in drafts] == [5, 3]


def test_a_greedy_decode_starts_probing_where_the_last_one_of_its_size_ended():
    """Drafts never accepted: the second greedy decode's first probe waits as long as the first decode's last wait
    grew to (plant: every decode from ``probe_every``); a sampled decode starts from ``probe_every`` (its draws follow
    its drafts: a seeded call must not depend on the calls before it), and so does a greedy one of another size."""
    chooser = CostAwareLength(Recorder(), LONGEST, CHEAP, probe_every=4)

    def first_probe(sampling, rows=1):
        chooser.begin(sampling, rows)
        states = chooser.new_rows([torch.ones(1, 4, dtype=torch.long)] * rows, [1000] * rows)
        lengths = []
        for _ in range(40):
            drafts = chooser.propose_rows(states, [torch.tensor(1)] * rows, sampling, [1000] * rows)
            lengths.append(drafts[0].tokens.shape[0] - 1)
            chooser.observe_rows(states, [torch.zeros(1, 1, 2)] * rows, [torch.ones(1, 1, dtype=torch.long)] * rows)
        first = lengths.index(0)
        return lengths.index(1, first) - first  # steps at 0 before the first probe

    assert first_probe(Sampling()) == 4  # then 8, 16: the decode ends waiting 32
    assert first_probe(Sampling()) == 32
    assert first_probe(Sampling(0.7)) == 4
    assert first_probe(Sampling(), rows=2) == 4


def test_a_chooser_without_costs_says_where_they_come_from():
    with pytest.raises(ValueError, match="no step costs for 1/greedy"):
        _run(CostAwareLength(Recorder(), LONGEST), lambda k: 0, 1)


def test_step_costs_refuse_bad_curves_and_smooth_noise():
    with pytest.raises(ValueError, match="lengths must ascend from 0"):
        StepCosts((1, 2), (0, 0), (1, 1), (0, 0))
    with pytest.raises(ValueError, match="verify must be 2 finite seconds"):
        StepCosts((0, 2), (0, 0), (1, -1), (0, 0))
    with pytest.raises(ValueError, match="k = 0"):
        StepCosts((0, 2), (0, 0), (0, 0), (0, 0))
    noisy = StepCosts((0, 1, 2, 4), (0, 1, 1, 2), (1.0, 3.0, 1.0, 4.0), (0, 0, 0, 0))
    assert noisy.verify == (1.0, 2.0, 2.0, 4.0)  # one slow measurement does not raise every longer draft
    assert noisy.step_seconds(3) == pytest.approx(1.5 + 3.0) and noisy.step_seconds(6) == pytest.approx(3 + 6)


@pytest.fixture(scope="module")
def tiny():
    return tiny_eagle3()


def test_drafting_is_fitted_as_a_cost_per_step_and_per_level():
    line = cost_profile.per_level([(1, 3.0), (2, 4.0), (4, 6.0), (4, 6.0), (16, 18.0)])
    assert line(0) == pytest.approx(2.0) and line(8) == pytest.approx(10.0)
    assert cost_profile.per_level([(1, 5.0), (8, 1.0)])(8) == pytest.approx(3.0)  # never cheaper per level: flat


def test_the_chosen_chain_measures_its_costs_once_per_key(tiny, tmp_path, monkeypatch):
    """An EAGLE head's chosen chain: its costs are measured on the first call, read from the cache by the next
    generator, measured again under another key (thread count); the stats show the choices."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(cost_profile, "measure_curve", lambda gen, d, b, s: measured.append((b, s.greedy)) or CHEAP)
    target, head = tiny
    gen = SpeculativeGenerator(target, chosen_chain(head, target))
    assert isinstance(gen.drafter, CostAwareLength)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(gen.generate(ids, max_new_tokens=12), ref)
    gen.generate(ids, max_new_tokens=12)
    stats = gen.last_stats
    assert sum(stats.draft_budgets.values()) == stats.steps and 3 in stats.draft_budgets  # the prior's first draft
    assert measured == [(1, True)]
    (path,) = (tmp_path / "step-costs").iterdir()
    assert json.loads(path.read_text())["curves"]["1/greedy"]["lengths"] == list(CHEAP.lengths)
    SpeculativeGenerator(target, chosen_chain(head, target)).generate(ids, max_new_tokens=4, temperature=0.5)
    assert measured == [(1, True), (1, False)]  # the cached greedy curve read, the sampled one measured
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        SpeculativeGenerator(target, chosen_chain(head, target)).generate(ids, max_new_tokens=4)
    finally:
        torch.set_num_threads(threads)
    assert measured[-1] == (1, True) and len(measured) == 3 and len(list((tmp_path / "step-costs").iterdir())) == 2
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a step-cost record"):
        load_costs(cost_profile.cost_key(gen, gen.drafter))


def test_the_profile_times_a_probe_that_observes_every_skipped_token(tiny, monkeypatch):
    """Plain steps are timed after ``PLAIN_WARM_STEPS``. Each round of the profile ends with a probe: ``PROBE_IDLE``
    steps at 0, then one level, whose drafter observes the prompt and every skipped token at once (plant: the level
    drafted first, then the steps at 0: no such observe); its seconds are the curve's ``probe``, kept in the record."""
    target, head = tiny
    gen = SpeculativeGenerator(target, chosen_chain(head, target))
    inner, seen = gen.drafter.drafter, []
    observe = inner.observe_rows
    monkeypatch.setattr(inner, "observe_rows", lambda s, f, t: seen.append([x.shape[1] for x in t]) or observe(s, f, t))
    timed, plain = cost_profile._timed_steps, []  # plain: (steps, timed steps) of each decode drafting nothing

    def spy(gen, drafter, ids, budget, sampling, levels, warm):
        times = timed(gen, drafter, ids, budget, sampling, levels, warm)
        if not any(levels):
            plain.append((len(levels), len(times)))
        return times

    monkeypatch.setattr(cost_profile, "_timed_steps", spy)
    curve = cost_profile.measure_curve(gen, gen.drafter, 2, Sampling())
    assert seen.count([cost_profile.PROMPT_TOKENS + PROBE_IDLE] * 2) == cost_profile.ROUNDS
    # plain steps are timed after their warm-up (plant: after WARM_STEPS, as a drafting step's)
    warm, timed_steps = cost_profile.PLAIN_WARM_STEPS, cost_profile.TIMED_STEPS
    assert plain == [(warm + timed_steps, timed_steps)] * cost_profile.ROUNDS
    assert curve.probe > 0 and curve.probe_seconds() == curve.probe
    assert StepCosts(**{**curve.to_json(), "probe": 0.0}).probe_seconds() == curve.step_seconds(1)
    with pytest.raises(ValueError, match="probe must be finite seconds"):
        StepCosts((0, 1), (0, 0), (1, 1), (0, 0), -1.0)


def test_the_profile_leaves_the_seeded_samples_as_they_were(tiny, tmp_path, monkeypatch):
    """A sampled call that measures its costs first samples what a call reading them from the cache samples."""
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    target, head = tiny
    ids = torch.tensor([[5, 6, 7, 8]])
    outs = []
    for _ in range(2):  # the first call measures, the second reads what it saved
        gen = SpeculativeGenerator(target, chosen_chain(head, target))
        torch.manual_seed(3)
        outs.append(gen.generate(ids, max_new_tokens=10, temperature=0.9))
    assert torch.equal(*outs)


def test_a_chosen_tree_drafts_its_dynamic_tree_cut_to_the_chosen_depth(tiny, monkeypatch):
    """``chosen_tree``: each step's draft is the dynamic tree cut to the depth the chooser chose (at 1 the root's
    top_k best children), within the tree's nodes; the counts are of the accepted path's depth; the profile times
    a tree of every depth; the output is the target's own. Plant (the drafter given the tree's full depth whatever
    was chosen, ``draft_by_batch`` ignoring ``max_depths``): the depths differ from the choices."""
    target, head = tiny
    chooser = chosen_tree(head, target, DynamicTree(depth=3, top_k=2, total_tokens=6))
    assert chooser.maximum == 3
    chosen, drafted = [], []
    choose, propose = chooser._choose, chooser.drafter.propose_rows
    monkeypatch.setattr(chooser, "_choose", lambda *a: chosen.append(choose(*a)[0]) or [chosen[-1]])
    monkeypatch.setattr(chooser.drafter, "propose_rows", lambda *a: [
        drafted.append((d.tree.retrieve_indices.shape[1] - 1, d.tokens.shape[0])) or d for d in propose(*a)])
    measure = cost_profile.measure_curve
    monkeypatch.setattr(cost_profile, "measure_curve", lambda gen, d, b, s: CHEAP)
    gen = SpeculativeGenerator(target, chooser)
    ids = torch.tensor([[5, 6, 7, 8]])
    ref = target.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0)
    assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)
    depths = [k for k in chosen if k]
    assert depths[0] == 3 and 1 in depths  # the prior's 3 first, a random head's 1 later
    # a tree keeps its most likely nodes: its depth is at most the one chosen, and at 1 it is the root's 2 children
    assert len(drafted) == len(depths) and all(d <= k for (d, _), k in zip(drafted, depths))
    assert all(nodes == 3 and d == 1 for (d, nodes), k in zip(drafted, depths) if k == 1)
    assert all(nodes <= 6 for _, nodes in drafted) and max(d for d, _ in drafted) >= 2
    drafted.clear()
    measure(gen, chooser, 1, Sampling())  # forced depths, as chosen ones
    assert {d for d, _ in drafted} >= {1, 2}


class Bush(Drafter):
    """A tree drafter stub: at every depth up to ``max_depth``, two children of the first node of the level above."""

    max_nodes = 2 * LONGEST + 1

    def new_rows(self, prompts, lengths):
        return [None] * len(prompts)

    def observe_rows(self, states, features, next_tokens):
        pass

    def propose_rows(self, states, roots, sampling, max_depths):
        drafts = []
        for root, depth in zip(roots, max_depths):
            parents = [-1] + [p for d in range(depth) for p in (max(2 * d - 1, 0),) * 2]
            drafts.append(Draft(torch.cat([root.reshape(1), torch.ones(2 * depth, dtype=torch.long)]),
                                tree_from_parents(parents)))
        return drafts


def test_a_tree_counts_the_depths_its_accepted_path_reached():
    """A tree of depth 2 (4 nodes) fully accepted counts a hit at depths 1 and 2 and nothing deeper (plant: the
    draft's node count as its depth, a miss counted at depth 3), as a chain of 2 would."""
    chooser = CostAwareLength(Bush(), 4, CHEAP)
    chooser.forced = 2
    chooser.begin(Sampling())
    (state,) = chooser.new_rows([torch.ones(1, 4, dtype=torch.long)], [1000])
    (draft,) = chooser.propose_rows([state], [torch.tensor(1)], Sampling(), [1000])
    assert draft.tokens.shape[0] == 5 and state.proposed == 2
    chooser.observe_rows([state], [torch.zeros(1, 3, 2)], [torch.ones(1, 3, dtype=torch.long)])
    assert state.tries == [1.0, 1.0, 0.0, 0.0] and state.hits == [1.0, 1.0, 0.0, 0.0]


def test_a_chosen_tree_is_a_dynamic_tree_the_head_drafts(tiny):
    target, head = tiny
    assert chosen_tree(head, target).drafter.option == DynamicTree(depth=5, top_k=2, total_tokens=8)  # CPU's
    for bad in (Chain(3), StaticTree(((0,), (1,)))):
        with pytest.raises(ValueError, match="a chosen tree is a dynamic tree a eagle3 head drafts, got"):
            chosen_tree(head, target, bad)
    with pytest.raises(ValueError, match="a chosen tree is a dynamic tree a medusa head drafts, got StaticTree"):
        chosen_tree(build_head("medusa", target), target)
