"""GenerationStats counts acceptance in vLLM's names (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos, mean_acceptance_length = 1 + accepted / drafts) and an acceptance histogram, per
call; calls pool by summing the counts before any ratio (never a mean of per-call means)."""
from __future__ import annotations

import pytest
import torch
from support.oracle import Oracle
from support.targets import make_tiny_target

from draftsmith.infer.decoding import GenerationStats
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.seeded_decode import tau_report


def _check_invariants(stats: GenerationStats) -> None:
    hist = stats.acceptance_histogram
    assert sum(hist.values()) == stats.num_drafts
    assert sum(k * n for k, n in hist.items()) == stats.num_accepted_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert per_pos == [sum(n for k, n in hist.items() if k > i) for i in range(len(per_pos))]
    assert stats.num_drafts == sum(n for k, n in stats.draft_budgets.items() if k > 0)
    assert stats.num_draft_tokens == sum(k * n for k, n in stats.draft_budgets.items())


@pytest.mark.parametrize("shape, right", [("chain", 2), ("ragged", 3), ("late", 2)])
def test_a_decode_counts_what_its_verifies_accepted(shape, right):
    target = make_tiny_target("llama", vocab_size=96, num_layers=2)
    target.generation_config.eos_token_id = None
    prompt = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                          pad_token_id=0)[0]
    gen = SpeculativeGenerator(target, Oracle([ref], shape=shape, right=right, depth=4))
    out = gen.generate(prompt, max_new_tokens=30)
    assert torch.equal(out[0], ref)
    stats = gen.last_stats
    _check_invariants(stats)
    assert stats.steps - 2 <= stats.num_drafts <= stats.steps  # one row; at the budget's end a draft may be empty
    if shape == "chain":  # every full chain accepts its 2 right drafts; the budget's end drafts shorter ones
        assert stats.acceptance_histogram[2] >= stats.num_drafts - 2 and set(stats.acceptance_histogram) <= {0, 1, 2}
    if shape == "late":  # a wrong first draft: nothing accepted, every step emits the bonus alone
        assert stats.acceptance_histogram == {0: stats.num_drafts} and stats.mean_acceptance_length == 1.0
    # no step was cut at EOS, so each step emitted its accepted drafts and the bonus
    assert stats.step_tokens == stats.num_accepted_tokens + stats.steps


def _calls() -> tuple[GenerationStats, GenerationStats]:
    one, two = GenerationStats(steps=1, step_tokens=4), GenerationStats(steps=3, step_tokens=3)
    one.count_draft(3, 3)  # a long request, all accepted
    for _ in range(3):
        two.count_draft(3, 0)  # a short one, nothing accepted
    two.count_draft(0, 0)  # a step that drafted nothing is no draft
    return one, two


def test_calls_pool_by_summed_counts():
    one, two = _calls()
    assert (one.mean_acceptance_length, two.mean_acceptance_length) == (4.0, 1.0)
    pooled = GenerationStats.pooled([one, two])
    assert pooled.num_drafts == 4 and pooled.num_draft_tokens == 12 and pooled.num_accepted_tokens == 3
    assert pooled.mean_acceptance_length == 1.75  # 1 + 3 / 4; the mean of the calls' means is 2.5
    assert pooled.num_accepted_tokens_per_pos == [1, 1, 1]
    assert pooled.acceptance_rate_per_pos == [0.25, 0.25, 0.25]
    assert pooled.acceptance_histogram == {3: 1, 0: 3}
    assert pooled.draft_acceptance_rate == 0.25
    assert (pooled.steps, pooled.step_tokens, pooled.tau) == (4, 7, 1.75)


def test_the_report_names_are_vllms_from_summed_counts():
    report = tau_report(list(_calls()), "real_tau_t1")
    assert report["mean_acceptance_length"] == 1.75 and report["real_tau_t1"] == 1.75
    assert report["num_accepted_tokens_per_pos"] == [1, 1, 1]
    assert report["acceptance_histogram"] == {"0": 3, "3": 1}
    assert report["acceptance_rate_per_pos"] == [0.25, 0.25, 0.25]
    assert report["real_tau_t1_low"] < 1.75 < report["real_tau_t1_high"]
    assert GenerationStats().acceptance()["draft_acceptance_rate"] is None
