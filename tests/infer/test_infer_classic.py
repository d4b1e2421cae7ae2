"""The classic drafters (draft model, n-gram prompt lookup, adaptive length) through the same
verify/accept/compact loop: greedy output equals ``target.generate`` token for token; a draft
model's sampled chain keeps the target's law (chi-square), and the test rejects a wrong ``q``."""
from __future__ import annotations

import random

import pytest
import torch
from support.targets import make_tiny_target, record_drafts
from support.sampling import PROMPT, exact_law, joint_pvalue, sample_triples
from support.classic import (  # noqa: F401  (fixture)
    ARCHES3,
    VOCAB,
    classic_target,
    repetitive_prompt,
    small_pair,
    small_pair_of,
)
from support.reference import hf_greedy

from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters.free.adaptive import AdaptiveLength
from draftsmith.infer.drafters.free.chooser import CostAwareLength
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter
from draftsmith.target.views import early_exit_view
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter, find_continuations, prefix_tree


def _drafters(arch: str, target, n: int | None = None):
    """Every classic drafter at its own size, or (``n``) each drafting at most n + 1 nodes, so one shape: a traced
    verify is traced once per budget, and the traced cases trace once (were 6 budgets, 4 to 33 nodes)."""
    def size(own: int) -> int:
        return own if n is None else n

    same = classic_target(arch)  # the target itself as draft model: every draft is accepted
    other = classic_target(arch, seed=7, num_layers=2)  # a different small model: most drafts rejected
    return {
        "lm-self": LMDrafter(same, target, Chain(size(4))),
        "lm-other": LMDrafter(other, target, Chain(size(3))),
        "lm-confidence": LMDrafter(same, target, Chain(size(5)), confidence=0.3),
        "ngram-chain": NgramDrafter(max_ngram=3, length=size(5)),
        "ngram-tree": NgramDrafter(max_ngram=2, length=size(8) // 2, branches=3 if n is None else 2),
        "adaptive-lm": AdaptiveLength(LMDrafter(other, target, Chain(size(16))), initial=2),
        "adaptive-ngram": AdaptiveLength(NgramDrafter(length=size(32) // 2, branches=2), initial=3),
        "layer-skip-1": LayerSkipDrafter(target, 1, Chain(size(3))),  # self-speculation: the target's first layer
        "layer-skip-default": LayerSkipDrafter(target, tree=Chain(size(4))),
    }


# eager: drafts at their own size, every family; traced ("eager" backend): padded to the budget, on llama (what
# a family changes, the caches, the eager cases prove; tracing repeated them for the other two), every drafter
# at one budget of 5 nodes (TRACED_N: one trace; lm-self fills it, the rest stop short and are padded)
TRACED_N = 4


@pytest.mark.parametrize("arch,compile", [(a, False) for a in ARCHES3] + [("llama", "eager")])
def test_greedy_matches_hf(arch, compile):
    target = classic_target(arch)
    rng = random.Random(arch)
    # the same prompts and HF references for every drafter (HF decoded 27 references a case, now 3)
    cases = [(repetitive_prompt(rng, prompt_len), max_new) for prompt_len, max_new in ((1, 1), (12, 30), (20, 7))]
    cases = [(ids, max_new, hf_greedy(target, ids, max_new)) for ids, max_new in cases]
    padded = set()  # the drafters some of whose drafts stopped short of the budget
    for name, drafter in _drafters(arch, target, TRACED_N if compile else None).items():
        gen = SpeculativeGenerator(target, drafter, compile=compile)
        sizes = record_drafts(drafter)  # every draft fits the drafter's max_nodes (a static verify step's budget)
        for ids, max_new, ref in cases:
            out = gen.generate(ids, max_new_tokens=max_new)
            assert torch.equal(out, ref), (name, ids.shape[1], max_new)
            assert all(d.tokens.numel() <= drafter.max_nodes for d in sizes), name
            if name == "lm-self" and max_new == 30:  # 29 tokens after the first in 6 steps of <= 5
                assert gen.last_stats.tau > 4.8, gen.last_stats.tau  # the draft cache stays in step
        padded |= {name} if any(d.tokens.numel() < drafter.max_nodes for d in sizes) else set()
    assert len(padded) >= 6, padded  # traced: most drafters' drafts were padded to the budget


# eager: drafts at their own size, every family; traced: padded to the budget, on llama (as the greedy test above)
@pytest.mark.parametrize("arch,compile", [(a, False) for a in ARCHES3] + [("llama", "eager")])
def test_eos_stops_like_hf(arch, compile):
    target = classic_target(arch)
    ids = repetitive_prompt(random.Random(1), 10)
    plain = hf_greedy(target, ids, 24)[0, 10:]
    eos = int(plain[9])  # a token HF emits: generation must stop at its first occurrence
    ref = hf_greedy(target, ids, 24, eos=eos)
    for name, drafter in _drafters(arch, target, TRACED_N if compile else None).items():
        out = SpeculativeGenerator(target, drafter, compile=compile).generate(ids, max_new_tokens=24, eos_token_id=eos)
        assert torch.equal(out, ref), name


def test_ngram_matching_and_tree():
    seq = torch.tensor([5, 6, 7, 8, 5, 6, 9, 5, 6])
    # The longest suffix with an earlier match is (5, 6); most recent match first.
    conts = find_continuations(seq, max_ngram=3, min_ngram=1, length=2, branches=2)
    assert [c.tolist() for c in conts] == [[9, 5], [7, 8]]
    assert find_continuations(torch.tensor([1, 2, 3]), 3, 1, 4, 1) == []
    # Looping text: the most recent (1, 2) is followed by only 4 tokens before the cursor, the earlier
    # one by a full 6; a full continuation wins, recency only breaks ties.
    loop = torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    assert find_continuations(loop, 2, 1, 6, 1)[0].tolist() == [3, 4, 1, 2, 3, 4]
    assert [c.tolist() for c in find_continuations(loop, 2, 1, 4, 2)] == [[3, 4, 1, 2], [3, 4, 1, 2]]
    draft = prefix_tree(torch.tensor(6), [torch.tensor([9, 5]), torch.tensor([9, 4]), torch.tensor([7])])
    assert draft.tokens.tolist() == [6, 9, 7, 5, 4]  # depth order; the shared 9 appears once
    assert draft.tree.parents.tolist() == [-1, 0, 0, 1, 1]


def test_ngram_drafter_accepts_drafts():
    """The prompt repeats itself after the target's own continuation, so lookups find text the
    target says again (random tiny targets repeat little: tau stays low, but above 1)."""
    target = classic_target("qwen2")
    prompt = repetitive_prompt(random.Random(4), 10)
    ids = torch.cat([hf_greedy(target, prompt, 40), prompt], dim=1)
    gen = SpeculativeGenerator(target, NgramDrafter())
    assert torch.equal(gen.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert gen.last_stats.tau > 1.2, gen.last_stats.tau


def test_adaptive_length_follows_acceptance():
    target = classic_target("llama")
    ids = repetitive_prompt(random.Random(4), 12)
    seen = []

    class Spy(AdaptiveLength):
        def propose_rows(self, states, roots, sampling, max_depths):  # the generator drafts every row at once
            seen.extend(state.length for state in states)
            return super().propose_rows(states, roots, sampling, max_depths)

    gen = SpeculativeGenerator(target, Spy(LMDrafter(classic_target("llama"), target, Chain(16)), initial=2, maximum=10))
    assert torch.equal(gen.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    assert seen[:5] == [2, 4, 6, 8, 10]  # a perfect drafter: +2 per step up to the cap
    seen.clear()
    other = classic_target("llama", seed=5, num_layers=1)
    gen = SpeculativeGenerator(target, Spy(LMDrafter(other, target, Chain(16)), initial=6))
    gen.generate(ids, max_new_tokens=20)
    assert min(seen) < 6  # rejections shrink it


def test_tokenizer_mismatch_is_refused():
    target = classic_target("llama")
    with pytest.raises(ValueError, match="vocab_size"):
        LMDrafter(make_tiny_target("llama", vocab_size=VOCAB + 1), target)
    with pytest.raises(ValueError, match="eos_token_id"):
        LMDrafter(make_tiny_target("llama", vocab_size=VOCAB, eos_token_id=3), target)


# ------------------------------------------------------------------------------- sampling


class WrongQ(LMDrafter):
    """Samples from q but reports a flattened q' to the acceptance rule: no longer lossless."""

    def propose_rows(self, states, roots, sampling, max_depths):
        drafts = super().propose_rows(states, roots, sampling, max_depths)
        for draft in drafts:
            if draft.q is not None:
                draft.q = (draft.q.sqrt() / draft.q.sqrt().sum(-1, keepdim=True))
        return drafts


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5, "top_p": 0.9}])
def test_draft_model_sampling_follows_the_target_law(small_pair, sampling):
    target, draft = small_pair
    gen = SpeculativeGenerator(target, LMDrafter(draft, target, Chain(3)))
    law = exact_law(target, sampling.get("temperature", 1.0), sampling.get("top_k", 0), sampling.get("top_p", 1.0))
    samples, forwards = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3
    assert forwards < 2.9, forwards  # some drafts were accepted


def test_wrong_q_is_detected(small_pair):
    target, draft = small_pair
    gen = SpeculativeGenerator(target, WrongQ(draft, target, Chain(3)))
    law = exact_law(target, 1.0, 0, 1.0)
    samples, _ = sample_triples(gen, 1000, temperature=1.0)  # p = 6e-13 at 1000 samples (seeded)
    assert joint_pvalue(samples, law) < 1e-6


def test_eagle_chain_confidence_stop():
    """A head chain stops a level early below the confidence threshold; output unchanged."""
    from draftsmith.heads import build_head
    from draftsmith.infer.drafters import make_drafter

    target = classic_target("qwen2")
    torch.manual_seed(0)
    head = build_head("eagle3", target)
    ids = repetitive_prompt(random.Random(5), 9)
    ref = hf_greedy(target, ids, 20)
    drafts = []
    for confidence in (None, 1.0):  # 1.0: no draft after the first (a random head: p < 1) is confident enough
        drafter = make_drafter(head, target, Chain(4), confidence=confidence)
        inner = drafter.propose_rows  # the generator drafts every row at once

        def recording(*args, inner=inner, **kwargs):
            out = inner(*args, **kwargs)
            drafts.extend(out)
            return out

        drafter.propose_rows = recording
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=20), ref)
        assert max(d.tokens.numel() for d in drafts) == (5 if confidence is None else 2)
        drafts.clear()


def test_ngram_tree_sampling_follows_the_target_law(small_pair):
    """Deterministic n-gram drafts (a tree of up to 3 matches) go through the tree sampling rule."""
    target, _ = small_pair
    gen = SpeculativeGenerator(target, NgramDrafter(max_ngram=2, length=2, branches=3))
    law = exact_law(target, 1.0, 0, 1.0)
    samples, forwards = sample_triples(gen, 2000, temperature=1.0)
    assert joint_pvalue(samples, law) > 1e-3
    # lookups were drafted and verified (a lookup is kept in about 1 call of 200 here, which call depending on the
    # random stream: 'some were kept' held for one stream and failed for issue 56's cheaper draw)
    verified = []
    for seed in range(4):
        torch.manual_seed(seed)
        gen.generate(PROMPT, max_new_tokens=3, temperature=1.0)
        verified.append(gen.last_stats.verified_tokens - gen.last_stats.steps)
    assert max(verified) > 0 and forwards <= 3.0, (verified, forwards)


# ------------------------------------------------------------------------------- layer skip


@pytest.mark.parametrize("arch", ARCHES3)
def test_early_exit_view_is_the_targets_first_layers(arch):
    target = classic_target(arch, num_layers=4)
    ids = repetitive_prompt(random.Random(2), 9)
    view = early_exit_view(target, 2)
    assert len(view.model.layers) == 2 and len(target.model.layers) == 4  # the target keeps its layers
    assert view.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    assert view.lm_head.weight is target.lm_head.weight and view.model.layers[1] is target.model.layers[1]
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states  # [embeds, after layer 1, 2, ...]
        expected = target.lm_head(target.model.norm(states[2]))  # stop after 2 layers, then norm and lm_head
        torch.testing.assert_close(view(ids).logits, expected, atol=1e-5, rtol=1e-5)
        full = target(ids).logits
    assert not torch.allclose(full, expected, atol=1e-3)  # the view is not the whole target
    with pytest.raises(ValueError, match="fewer than the target's 4 layers; got k=4"):
        early_exit_view(target, 4)
    with pytest.raises(ValueError, match="layer-skip layers must be >= 1, got 0"):
        early_exit_view(target, 0)


# One family: the sampling rule is the family's no more than greedy's is (the greedy tests run layer skip on
# every family's cache; the chi-square on each of three repeated one law check)
@pytest.mark.parametrize("arch", ["qwen2"])
def test_layer_skip_sampling_follows_the_target_law(arch):
    target, _ = small_pair_of(arch)  # eager: the draft writes the first layer's KV into the target's cache
    gen = SpeculativeGenerator(target, LayerSkipDrafter(target, 1, Chain(3)))
    law = exact_law(target, 1.0, 0, 1.0)
    samples, forwards = sample_triples(gen, 2000, temperature=1.0)
    assert joint_pvalue(samples, law) > 1e-3
    assert forwards < 2.99, forwards  # some drafts were accepted


def test_eagle_heads_adapt_their_chain_by_default_on_cpu():
    """On CPU a generator given an EAGLE head and no tree drafts an adaptive chain (from 4, up to 16) greedy,
    which beat every fixed chain measured (docs/benchmarks.md), and the chooser's chain of the same drafter sampled
    (issue 56); a tree given, or Medusa, stays as it is."""
    from draftsmith.heads import build_head
    from draftsmith.infer.drafters import HeadDrafter, StaticTree

    target = classic_target("llama")
    ids = repetitive_prompt(random.Random(4), 12)
    for kind in ("eagle", "eagle3"):
        gen = SpeculativeGenerator(target, build_head(kind, target))
        greedy, sampled = gen.drafter.greedy, gen.drafter.sampled  # a ByTemperature: at T > 0 the chooser drafts
        assert isinstance(greedy, AdaptiveLength) and (greedy.initial, greedy.maximum) == (4, 16)
        assert isinstance(sampled, CostAwareLength) and sampled.maximum == 16 and sampled.drafter is greedy.drafter
        assert torch.equal(gen.generate(ids, max_new_tokens=24), hf_greedy(target, ids, 24))
        fixed = SpeculativeGenerator(target, build_head(kind, target), tree=Chain(4)).drafter
        assert isinstance(fixed, HeadDrafter) and fixed.option == Chain(4)
    medusa = SpeculativeGenerator(target, build_head("medusa", target)).drafter
    assert isinstance(medusa, HeadDrafter) and isinstance(medusa.option, StaticTree)
