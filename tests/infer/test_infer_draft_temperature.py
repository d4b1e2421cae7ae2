"""Sampled drafts at a head's fitted draft temperature (``Eagle3Config.draft_temperature``): each level's law is the
head's logits over that depth's temperature, then the serving temperature; greedy drafts ignore it; sampling stays
the target's law (chi-square on the first three tokens, a sampled chain and a sampled static tree verified by
traversal)."""
from __future__ import annotations

import pytest
import torch
from support.sampling import PROMPT, exact_law, joint_pvalue, sample_triples, small_target  # noqa: F401  (fixture)

import draftsmith.infer.drafters.eagle as eagle_module
from draftsmith.heads import build_head
from draftsmith.heads.eagle3 import Eagle3Config
from draftsmith.infer import Chain, SpeculativeGenerator, StaticTree
from draftsmith.infer.drafters.base import Sampling

TEMPERATURES = [0.4, 2.5]  # the first draft sharpened, the second (and deeper) flattened


def _tempered_head(target, temperatures=TEMPERATURES):
    torch.manual_seed(2)
    head = build_head("eagle3", target)
    head.config.draft_temperature = list(temperatures)
    return head


def test_each_sampled_level_draws_from_the_logits_over_its_depths_temperature(small_target, monkeypatch):
    """Three levels of a chain at T = 0.8: level i's law is softmax(z_i / (s_i x 0.8)), the third at the last
    temperature; the law the verifier reads is the one drawn from."""
    gen = SpeculativeGenerator(small_target, _tempered_head(small_target), tree=Chain(3))
    drafter = gen.drafter
    assert drafter.draft_temperature == (0.4, 2.5)
    logits_seen, laws_drawn = [], []
    compute, draw = drafter._logits, eagle_module.categorical

    def logits_spy(hidden):
        out = compute(hidden)
        logits_seen.append(out)
        return out

    def draw_spy(q):
        laws_drawn.append(q)
        return draw(q)

    monkeypatch.setattr(drafter, "_logits", logits_spy)
    monkeypatch.setattr(eagle_module, "categorical", draw_spy)
    torch.manual_seed(0)
    gen.generate(PROMPT, max_new_tokens=8, temperature=0.8)
    assert len(laws_drawn) >= 3 and len(logits_seen) == len(laws_drawn)
    sampling = Sampling(0.8)
    for depth, (logits, law) in enumerate(zip(logits_seen[:3], laws_drawn[:3])):  # the first step's three levels
        s = TEMPERATURES[min(depth, 1)]
        torch.testing.assert_close(law, sampling.probs(logits / s))
        assert not torch.allclose(law, sampling.probs(logits))  # the temperature moved it


def test_greedy_drafts_and_heads_without_a_fit_are_as_before(small_target):
    tempered = SpeculativeGenerator(small_target, _tempered_head(small_target), tree=Chain(3))
    plain_head = _tempered_head(small_target, TEMPERATURES)
    plain_head.config.draft_temperature = None
    plain = SpeculativeGenerator(small_target, plain_head, tree=Chain(3))
    assert plain.drafter.draft_temperature == ()
    greedy = small_target.generate(PROMPT, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(tempered.generate(PROMPT, max_new_tokens=12), greedy)
    assert torch.equal(plain.generate(PROMPT, max_new_tokens=12), greedy)
    logits = torch.randn(4, 8)
    assert torch.equal(plain.drafter._sampled_law(logits, Sampling(0.7), 2), Sampling(0.7).probs(logits))


@pytest.mark.parametrize("tree, acceptance, sampling", [
    (Chain(2), "exact", {"temperature": 0.9}),
    (StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0)), sampled=True), "traversal", {"temperature": 1.0, "top_k": 6}),
])
def test_sampling_at_a_draft_temperature_keeps_the_targets_law(small_target, tree, acceptance, sampling):
    gen = SpeculativeGenerator(small_target, _tempered_head(small_target), tree=tree, acceptance=acceptance)
    law = exact_law(small_target, sampling["temperature"], sampling.get("top_k", 0), 1.0)
    samples, forwards = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3
    assert forwards < 2.9, forwards  # drafts were accepted: the draft law took part


def test_a_draw_from_another_law_than_the_one_verified_is_caught(small_target, monkeypatch):
    """The harness can fail here: each draft is the token the head's (tempered) law ranks last, while the verifier
    reads that law. (A law recorded untempered beside a tempered draw is the spy test's to catch: at this head's
    acceptance the chi-square has too little power for it.)"""
    monkeypatch.setattr(eagle_module, "categorical", lambda q: q.argmin(-1))
    gen = SpeculativeGenerator(small_target, _tempered_head(small_target), tree=Chain(2))
    samples, _ = sample_triples(gen, 2000, temperature=0.9)
    assert joint_pvalue(samples, exact_law(small_target, 0.9, 0, 1.0)) < 1e-6


def test_a_draft_temperature_that_is_no_list_of_positive_numbers_is_one_line():
    for bad in ([], [0.0], [1.0, -2], "1.5", [float("inf")], [True]):
        with pytest.raises(ValueError, match="draft_temperature must be null or a non-empty list"):
            Eagle3Config(draft_temperature=bad)
    assert Eagle3Config(draft_temperature=[2, 1.5]).draft_temperature == [2.0, 1.5]


def test_a_sampled_static_tree_draws_each_level_at_its_depth(small_target, monkeypatch):
    """A sampled static tree asks for the root's children's law at depth 0 and their children's at depth 1 (plant: a
    static tree passing its level, 1-based, as the depth)."""
    gen = SpeculativeGenerator(small_target, _tempered_head(small_target),
                               tree=StaticTree(((0,), (1,), (0, 0), (1, 0)), sampled=True), acceptance="traversal")
    depths, law = [], gen.drafter._sampled_law
    monkeypatch.setattr(gen.drafter, "_sampled_law", lambda logits, sampling, depth: depths.append(depth) or
                        law(logits, sampling, depth))
    torch.manual_seed(0)
    gen.generate(PROMPT, max_new_tokens=6, temperature=1.0)
    assert depths[:3] == [0, 1, 1]
