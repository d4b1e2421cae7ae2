"""Helpers moved out of tests/infer/test_infer_sampling.py (other test files share them; no tests here)."""
from __future__ import annotations

import itertools

import pytest
import torch
from support.targets import make_tiny_target
from support.accept import chi_square_pvalue, reference_probs
from support.chooser import CHEAP

from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator, StaticTree
from draftsmith.heads import build_head
from draftsmith.infer.drafters import Draft, Drafter, Sampling, make_drafter
from draftsmith.infer.drafters.free.chooser import CostAwareLength
from draftsmith.infer.tree import tree_from_parents


VOCAB = 8
CHOSEN = "chosen"  # a CONFIGS tree: the draft-length chooser's chain
CHOSEN_TREE = "chosen-tree"  # a CONFIGS tree: the chooser's dynamic tree (its depth chosen)
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
# one-row calls per sample_triples: the mean of forwards in {2, 3} per call, within 0.07 (one SD) at 50 calls; they
# cost 0.02 s each against 0.12 s for a call of ROWS rows, so 200 of them were 2/3 of a 2000-sample test
SINGLE = 50


def sample_triples(gen: SpeculativeGenerator, n: int, **sampling) -> tuple[torch.Tensor, float]:
    """(n, 3) samples of the first three new tokens, and the mean target forwards of a one-row call.

    The first n // 10 samples, at most ``SINGLE``, come from one-row calls (their forwards give the mean);
    the rest from calls of ``ROWS`` copies of PROMPT, where each row samples on its own: about 15x cheaper
    per sample on CPU. A batch that drew one random number for all its rows would repeat its samples in
    groups, which the chi-square rejects."""
    torch.manual_seed(0)
    single = min(max(n // 10, 1), SINGLE)
    out, forwards = [], 0
    for _ in range(single):
        out.append(gen.generate(PROMPT, max_new_tokens=3, **sampling)[0, 3:])
        forwards += gen.last_stats.target_forwards
    left = n - single
    while left:
        rows = min(ROWS, left)
        # a compiled generator traces each batch size anew (~1/3 of a traced test's compile time here): it
        # samples ROWS rows in the last call too and keeps the first ``rows`` (the rows are independent)
        batch = ROWS if gen.compile else rows
        out.extend(gen.generate(PROMPT.repeat(batch, 1), max_new_tokens=3, **sampling)[:rows, 3:])
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


CONFIGS = {
    "eagle3-tree": ("eagle3", DynamicTree(depth=3, top_k=3, total_tokens=8), {"temperature": 0.9, "top_k": 5}),
    "eagle-chain": ("eagle", Chain(2), {"temperature": 1.2, "top_p": 0.85}),
    "medusa-tree": ("medusa", StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))), {"temperature": 0.7}),
    "stub-full-tree": (None, None, {"temperature": 1.0, "top_k": 6, "top_p": 0.95}),
    "eagle-chosen": ("eagle", CHOSEN, {"temperature": 0.8, "top_k": 6}),
    "eagle3-chosen-tree": ("eagle3", CHOSEN_TREE, {"temperature": 1.0, "top_k": 6}),
}


def config_generator(model, kind: str | None, tree, compile=False) -> SpeculativeGenerator:
    """The generator of a ``CONFIGS`` entry (its head built from torch's current seed): the stub drafter, a head
    drafting ``tree``, or (``CHOSEN``, ``CHOSEN_TREE``) a head's chain of 3 or dynamic tree of depth 3 whose length
    or depth the chooser picks from ``CHEAP`` costs."""
    if kind is None:
        return SpeculativeGenerator(model, FullWidthDrafter(), compile=compile)
    head = build_head(kind, model)
    if tree in (CHOSEN, CHOSEN_TREE):
        shape = Chain(3) if tree == CHOSEN else DynamicTree(depth=3, top_k=3, total_tokens=8)
        return SpeculativeGenerator(model, CostAwareLength(make_drafter(head, model, shape), 3, CHEAP),
                                    compile=compile)
    return SpeculativeGenerator(model, head, tree=tree, compile=compile)
