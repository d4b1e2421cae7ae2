"""End-to-end sampling: the first three generated tokens follow the target's law under HF's
``generate(do_sample=True, temperature, top_k, top_p)``, computed exactly on a small-vocabulary
target, for trees (EAGLE-2/3 dynamic, Medusa static, a full-width stub tree) and sampled chains,
including the bonus token. Chi-square on the joint law of (x1, x2, x3), fixed seeds."""
from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_target
from test_infer_accept import chi_square_pvalue, reference_probs

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator, StaticTree
from draftsmith.infer.drafters import Draft, Drafter, Sampling
from draftsmith.infer.tree import tree_from_parents

VOCAB = 8
PROMPT = torch.tensor([[1, 5, 3]])


def make_small_target():
    """The sampling tests' target: 8 tokens, so the joint law of three tokens is enumerable."""
    model = make_tiny_target(
        "llama", vocab_size=VOCAB, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32,
        initializer_range=0.5, seed=3,
    )
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def small_target():
    return make_small_target()


def exact_law(model, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """P(x1, x2, x3) (V, V, V) from the target's logits through the warpers."""
    with torch.no_grad():
        def law(contexts: torch.Tensor) -> torch.Tensor:
            logits = model(contexts).logits[:, -1]
            return torch.stack([reference_probs(row, temperature, top_k, top_p) for row in logits])

        p1 = law(PROMPT)[0]  # (V,)
        x1 = torch.arange(VOCAB)[:, None]
        p2 = law(torch.cat([PROMPT.expand(VOCAB, -1), x1], dim=1))  # (V, V)
        pairs = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
        p3 = law(torch.cat([PROMPT.expand(VOCAB * VOCAB, -1), pairs], dim=1)).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


ROWS = 100  # rows per batched sampling call


def sample_triples(gen: SpeculativeGenerator, n: int, **sampling) -> tuple[torch.Tensor, float]:
    """(n, 3) samples of the first three new tokens, and the mean target forwards of a one-row call.

    The first n // 10 samples come from one-row calls (their forwards give the mean); the rest from
    calls of ``ROWS`` copies of PROMPT, where each row samples on its own: about 8x cheaper per sample
    on CPU. A batch that drew one random number for all its rows would repeat its samples in groups,
    which the chi-square rejects."""
    torch.manual_seed(0)
    single = max(n // 10, 1)
    out, forwards = [], 0
    for _ in range(single):
        out.append(gen.generate(PROMPT, max_new_tokens=3, **sampling)[0, 3:])
        forwards += gen.last_stats.target_forwards
    left = n - single
    while left:
        rows = min(ROWS, left)
        out.extend(gen.generate(PROMPT.repeat(rows, 1), max_new_tokens=3, **sampling)[:, 3:])
        left -= rows
    return torch.stack(out), forwards / single


def joint_pvalue(samples: torch.Tensor, law: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square on the joint, pooling cells whose expected count is below ``min_expected``."""
    flat = law.flatten().double()
    counts = torch.bincount(samples[:, 0] * VOCAB * VOCAB + samples[:, 1] * VOCAB + samples[:, 2],
                            minlength=flat.numel())
    if counts[flat == 0].sum() > 0:
        return 0.0  # an impossible sequence was produced
    small = (flat * samples.shape[0] < min_expected) & (flat > 0)
    pooled_counts = torch.cat([counts[~small & (flat > 0)], counts[small].sum()[None]])
    pooled_law = torch.cat([flat[~small & (flat > 0)], flat[small].sum()[None]])
    return chi_square_pvalue(pooled_counts, pooled_law)


class FullWidthDrafter(Drafter):
    """Stub drafter: every token at depth 1 and the 3 first ids under each at depth 2, so every
    first token is found among the siblings (rejections renormalise p) and depth 2 is often hit."""

    aux_layer_ids = ()
    max_nodes = 1 + VOCAB + 3 * VOCAB  # the tree budget a static cache pads to

    def new_rows(self, prompts, lengths):
        return [None] * len(prompts)

    def observe_rows(self, states, features, next_tokens):
        pass

    def propose_rows(self, states, roots, sampling: Sampling, max_depths: list[int]) -> list[Draft]:
        return [self._propose(r, d) for r, d in zip(roots, max_depths)]

    def _propose(self, root, max_depth: int) -> Draft:
        parents, tokens = [-1], [int(root)]
        if max_depth >= 1:
            parents += [0] * VOCAB
            tokens += list(range(VOCAB))[::-1]
        if max_depth >= 2:
            for node in range(1, VOCAB + 1):
                parents += [node] * 3
                tokens += [1, 4, 6]
        return Draft(torch.tensor(tokens), tree_from_parents(parents))


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


CONFIGS = {
    "eagle3-tree": ("eagle3", DynamicTree(depth=3, top_k=3, total_tokens=8), {"temperature": 0.9, "top_k": 5}),
    "eagle-chain": ("eagle", Chain(2), {"temperature": 1.2, "top_p": 0.85}),
    "medusa-tree": ("medusa", StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))), {"temperature": 0.7}),
    "stub-full-tree": (None, None, {"temperature": 1.0, "top_k": 6, "top_p": 0.95}),
}


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, "eager"])  # eager: drafts at their own size; traced: padded to the budget
@pytest.mark.parametrize("name", list(CONFIGS))
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
    # Without any accepted draft every call takes 3 forwards (prefill + 2 steps).
    assert forwards < 2.8, forwards


def test_sampling_test_detects_a_wrong_temperature(small_target):
    """The same harness rejects samples drawn at the wrong temperature (it can fail)."""
    gen = SpeculativeGenerator(small_target, FullWidthDrafter())
    law = exact_law(small_target, 1.0, 0, 1.0)
    samples, _ = sample_triples(gen, 1500, temperature=1.6)
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
