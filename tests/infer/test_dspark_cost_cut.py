"""DSpark's confidence in the cost-aware chooser (``infer.drafters.variants.dspark.cost_cut``): under a chooser's step
costs a row verifies the prefix of its block with the most expected tokens per second, its confidences read as each
slot's acceptance given the ones before; the chooser's profile (forced lengths) keeps every draft; without a chooser
the threshold cuts as before. Lossless either way: greedy output equals HF's, a left-padded batch row by row, and the
first sampled tokens follow the target's law (chi-square).

Plants (each made once, each failed the test named): ``cost_cut`` keeping every draft
(test_the_cut_by_hand, test_rows_are_cut_by_their_own_confidence); each row cut by row 0's confidences
(test_rows_are_cut_by_their_own_confidence); the profile's forced steps cut by the threshold
(test_the_profile_keeps_every_draft)."""
from __future__ import annotations

import random

import pytest
import torch
from support.chooser import FLAT, LENGTHS, STEEP
from support.dflash_infer import perturbed
from support.reference import hf_greedy
from support.sampling import exact_law, joint_pvalue, sample_triples, small_target  # noqa: F401  (fixture)
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters import CostAwareLength, Sampling, make_drafter
from draftsmith.infer.cost_model import StepCosts
from draftsmith.infer.drafters.variants import dspark
from draftsmith.infer.drafters.variants.dspark import cost_cut, markov_walk

VOCAB = 96
SMALL = {"block_size": 5, "num_layers": 1, "markov_rank": 8, "variant": "dspark"}


def _moved(head, seed: int = 5, scale: float = 0.5):
    """A DSpark head whose confidences spread: every weight perturbed, the Markov factors large."""
    return perturbed(head, lambda n: "markov" in n, seed, scale)


# a verify costing 0.3 of a token's forward per extra token, drafting 0.01 a level: between FLAT and STEEP
MODERATE = StepCosts(LENGTHS, tuple(0.01 * k for k in LENGTHS), tuple(1 + 0.3 * k for k in LENGTHS), (0.0,) * 6)


def test_the_cut_by_hand():
    # 4 slots drafted (0.04 s paid), a verify of k + 1 tokens 1 + 0.3 k: E(k) = 1, 1.9, 2.71, 2.75, 2.79 over
    # 1.04, 1.34, 1.64, 1.94, 2.24 s: 0.96, 1.42, 1.65, 1.42, 1.24 tokens a second
    assert cost_cut([0.9, 0.9, 0.05, 0.9], MODERATE, 4) == 2
    assert cost_cut([0.9, 0.9, 0.05, 0.9], FLAT, 4) == 4  # a flat verify: every slot that may be kept pays
    assert cost_cut([0.9, 0.9, 0.05, 0.9], STEEP, 4) == 0  # a token's forward per token: only sure drafts pay
    assert cost_cut([0.0, 0.9], FLAT, 2) == 0  # nothing can be kept: the root alone (a tie goes to the shorter)
    assert cost_cut([1.0] * 3, MODERATE, 3) == 3
    assert cost_cut([0.4] * 3, STEEP, 3) == 0


def _rows(monkeypatch, target, head, costs, rows: int = 4, chain: int = 4):
    """Each row's draft length and confidences (a batch on random features) under a chooser whose rows have kept
    every draft so far (so it drafts ``chain``; ``costs=None``: its profile, forcing ``chain``)."""
    chooser = CostAwareLength(make_drafter(head, target, Chain(chain)), maximum=chain, costs=costs)
    chooser.forced = chain if costs is None else None
    width = len(head.feature_layer_ids) * target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    states = chooser.new_rows([torch.zeros(1, 12, dtype=torch.long)] * rows, [12] * rows)
    chooser.observe_rows(states, [torch.randn(1, 6 + b, width, generator=gen) for b in range(rows)],
                         [torch.randint(3, VOCAB, (1, 6 + b), generator=gen) for b in range(rows)])
    for s in states:
        s.hits, s.tries = [10.0] * chain, [10.0] * chain
    walks = []
    monkeypatch.setattr(dspark, "markov_walk", lambda *a: walks.append(markov_walk(*a)) or walks[-1])
    drafts = chooser.propose_rows(states, [torch.tensor(10 + b) for b in range(rows)], Sampling(), [chain] * rows)
    return [d.tokens.shape[0] - 1 for d in drafts], walks[-1][2].sigmoid().tolist()


def test_rows_are_cut_by_their_own_confidence(monkeypatch):
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    lengths, accept = _rows(monkeypatch, target, head, MODERATE)
    assert lengths == [cost_cut(a, MODERATE, 4) for a in accept]
    assert len(set(lengths)) > 1, (lengths, accept)  # the rows differ: the check reads each row's own


def test_the_profile_keeps_every_draft(monkeypatch):
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    with torch.no_grad():
        head.confidence_head.proj.bias.fill_(-50.0)  # every slot below any threshold
    lengths, _ = _rows(monkeypatch, target, head, None)
    assert lengths == [4] * 4


def _chosen(target, head, costs, chain: int = 4):
    return SpeculativeGenerator(target, CostAwareLength(make_drafter(head, target, Chain(chain)), maximum=chain,
                                                        costs=costs))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_hf_under_the_chooser(arch):
    target = make_tiny_target(arch, initializer_range=0.3)
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    rng = random.Random(f"dspark-cost-{arch}")
    for costs in (MODERATE, FLAT):
        gen = _chosen(target, head, costs)
        for prompt_len, max_new in ((5, 24), (1, 7)):
            ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(prompt_len)]])
            assert torch.equal(gen.generate(ids, max_new_tokens=max_new), hf_greedy(target, ids, max_new))
    ids = torch.tensor([[0, 0, 0, 7, 8, 9], [11, 12, 13, 14, 15, 16]])  # a left-padded batch, row by row
    out = _chosen(target, head, MODERATE).generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=12)
    for b, (row, n) in enumerate(((ids[:1, 3:], 3), (ids[1:], 6))):
        assert torch.equal(out[b, 6:], hf_greedy(target, row, 12)[0, n:]), b


@pytest.mark.slow  # as tests/infer/test_infer_sampling.py's
def test_first_tokens_follow_the_target_law_under_the_chooser(small_target):  # noqa: F811
    sampling = {"temperature": 0.9, "top_k": 6}
    torch.manual_seed(1)
    head = _moved(build_head("dflash", small_target, variant="dspark", block_size=4, markov_rank=4), scale=0.2)
    gen = _chosen(small_target, head, MODERATE, chain=3)
    law = exact_law(small_target, sampling["temperature"], sampling["top_k"], 1.0)
    samples, _ = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3
