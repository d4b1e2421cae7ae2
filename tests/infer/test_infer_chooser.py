"""The draft-length chooser (``infer.drafters.free.chooser``) and the step costs it reads (``infer.cost_model``,
``infer.cost_profile``). Costs are given here, never timed: the profile's measurement is replaced where it would
run, except in the one test that checks it leaves torch's random state as it was."""
from __future__ import annotations

import json

import pytest
import torch
from support.chooser import CHEAP, FLAT, STEEP, tiny_eagle3

from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer import cost_profile
from draftsmith.infer.cost_model import StepCosts, load_costs
from draftsmith.infer.drafters import Draft, Drafter, Sampling, chain_buffers, chosen_chain
from draftsmith.infer.drafters.free.chooser import CostAwareLength, acceptance, batch_length, best_length

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
    """A depth never reached takes the estimate of the depth before it; counts pull it to what was seen."""
    assert acceptance([0.0, 0.0], [0.0, 0.0], 0.6) == [0.6, 0.6]
    p = acceptance([9.0, 0.0, 0.0], [9.0, 9.0, 0.0], 0.6)
    assert p[0] == pytest.approx(9.6 / 10) and p[1] == pytest.approx(0.96 / 10) and p[2] == pytest.approx(p[1])


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


def _run(chooser: CostAwareLength, accept, steps: int) -> list[int]:
    """``steps`` steps of one row; ``accept(k)`` drafts of each k-level draft accepted. Returns the lengths drafted."""
    (state,) = chooser.new_rows([torch.ones(1, 4, dtype=torch.long)], [1000])
    chooser.observe_rows([state], [torch.zeros(1, 4, 2)], [torch.ones(1, 4, dtype=torch.long)])
    lengths = []
    for _ in range(steps):
        (draft,) = chooser.propose_rows([state], [torch.tensor(1)], Sampling(), [1000])
        k = draft.tokens.shape[0] - 1
        lengths.append(k)
        a = accept(k)
        chooser.observe_rows([state], [torch.zeros(1, a + 1, 2)], [torch.ones(1, a + 1, dtype=torch.long)])
    return lengths


def test_the_chooser_learns_each_rows_acceptance_online():
    """Every draft accepted: the chain grows to the longest. None accepted: the row stops drafting, probes one
    level after ``probe_every`` steps at 0, then after twice as many each time a probe misses, and observes the
    waiting tokens in one call before it drafts again. A probe accepted starts drafting again."""
    assert _run(CostAwareLength(Recorder(), LONGEST, CHEAP), lambda k: k, 20)[-5:] == [LONGEST] * 5
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
