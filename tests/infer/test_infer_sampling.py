"""End-to-end sampling: the first three generated tokens follow the target's law under HF's
``generate(do_sample=True, temperature, top_k, top_p)``, computed exactly on a small-vocabulary
target, for trees (EAGLE-2/3 dynamic, Medusa static, a full-width stub tree) and sampled chains,
including the bonus token. Chi-square on the joint law of (x1, x2, x3), fixed seeds."""
from __future__ import annotations


import pytest
import torch
from support.accept import reference_probs
from support.sampling import (  # noqa: F401  (fixture)
    CONFIGS,
    PROMPT,
    VOCAB,
    FullWidthDrafter,
    exact_law,
    joint_pvalue,
    sample_triples,
    small_target,
)

from draftsmith.heads import build_head
from draftsmith.infer import SpeculativeGenerator


def test_reference_law_matches_hf_generate_scores(small_target):
    """The independent reference of the warpers equals the scores HF's sampling loop uses."""
    torch.manual_seed(0)
    out = small_target.generate(
        PROMPT, do_sample=True, max_new_tokens=3, temperature=0.8, top_k=5, top_p=0.9,
        output_scores=True, return_dict_in_generate=True, pad_token_id=0,
    )
    seq = out.sequences[0]
    with torch.no_grad():
        logits = small_target(seq[None]).logits[0]
    for step, scores in enumerate(out.scores):
        torch.testing.assert_close(
            scores[0].softmax(-1).double(), reference_probs(logits[2 + step], 0.8, 5, 0.9), rtol=1e-5, atol=1e-6
        )


# eager: drafts at their own size, every config; traced: padded to the budget, on a dynamic tree and a chain (the
# padding is the verify's, whichever drafter filled it: tracing the static and the stub trees repeated these)
@pytest.mark.slow
@pytest.mark.parametrize("name,compile", [(n, False) for n in CONFIGS] + [("eagle3-tree", "eager"),
                                                                           ("eagle-chain", "eager")])
def test_first_tokens_follow_the_target_law(small_target, name, compile):
    kind, tree, sampling = CONFIGS[name]
    if kind is None:
        gen = SpeculativeGenerator(small_target, FullWidthDrafter(), compile=compile)
    else:
        torch.manual_seed(1)
        gen = SpeculativeGenerator(small_target, build_head(kind, small_target), tree=tree, compile=compile)
    law = exact_law(small_target, sampling.get("temperature", 1.0), sampling.get("top_k", 0), sampling.get("top_p", 1.0))
    samples, forwards = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3
    # Without any accepted draft every call takes 3 forwards (prefill + 2 steps): the mean over sample_triples'
    # one-row calls is 3.0 exactly then
    assert forwards < 2.9, forwards


def test_sampling_test_detects_a_wrong_temperature(small_target):
    """The same harness rejects samples drawn at the wrong temperature (it can fail)."""
    gen = SpeculativeGenerator(small_target, FullWidthDrafter())
    law = exact_law(small_target, 1.0, 0, 1.0)
    samples, _ = sample_triples(gen, 500, temperature=1.6)  # p = 3e-33 at 500 samples (seeded)
    assert joint_pvalue(samples, law) < 1e-6


def test_typical_acceptance_is_opt_in(small_target):
    """Medusa's lossy typical acceptance runs only when asked for; unknown rules are refused."""
    torch.manual_seed(0)
    head = build_head("medusa", small_target)
    gen = SpeculativeGenerator(small_target, head, acceptance="typical")
    out = gen.generate(PROMPT, max_new_tokens=12, temperature=0.7)
    assert out.shape == (1, 15) and int(out.max()) < VOCAB
    assert SpeculativeGenerator(small_target, head).acceptance == "exact"
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeGenerator(small_target, head, acceptance="greedy-ish")
