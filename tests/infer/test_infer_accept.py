"""infer.accept: greedy rule on hand-made cases, HF warper semantics, and statistical tests of the
lossless sampling rules (many vectorised trials on a small vocabulary, chi-square with fixed seeds).

The losslessness property checked at every tree node u: among trials whose emitted run reaches u
and continues past it, the next emitted token follows the target law p_u exactly. A broken rule is
run through the same harness to show the test can fail.
"""
from __future__ import annotations

import pytest
import torch

from draftsmith.infer.accept import (
    chain_sample_accept,
    check_sampling_params,
    greedy_accept_rows,
    sampling_probs,
    tree_sample_accept,
    typical_accept,
)
from draftsmith.infer.tree import tree_from_parents
from support.accept import chi_square_pvalue, reference_probs


def greedy_accept(logits: torch.Tensor, tokens: torch.Tensor, retrieve_indices: torch.Tensor):
    """One row of ``greedy_accept_rows``: logits (N, V), tokens (N,), retrieve_indices (P, D+1)."""
    return greedy_accept_rows(logits[None], tokens[None], retrieve_indices[None])


# ------------------------------------------------------------------------------------ greedy


def test_greedy_accept_longest_path_and_bonus():
    tree = tree_from_parents([-1, 0, 0, 1, 2, 3])  # paths 0-1-3-5 and 0-2-4
    tokens = torch.tensor([9, 4, 5, 6, 7, 8])
    argmax = torch.tensor([4, 6, 7, 1, 3, 2])  # target's choice after each node
    logits = torch.nn.functional.one_hot(argmax, 10).float()
    acc = greedy_accept(logits, tokens, tree.retrieve_indices)
    # After root: 4 (node 1) ok, then 6 (node 3) ok, then 8 (node 5) vs argmax 1 -> stop.
    assert acc.nodes[0, : acc.length[0]].tolist() == [0, 1, 3]
    assert acc.bonus.tolist() == [1]


def test_greedy_accept_none_and_first_tie():
    tree = tree_from_parents([-1, 0, 0])
    tokens = torch.tensor([9, 3, 3])  # two siblings with the same token: first wins
    logits = torch.nn.functional.one_hot(torch.tensor([3, 5, 6]), 10).float()
    acc = greedy_accept(logits, tokens, tree.retrieve_indices)
    assert acc.nodes[0, : acc.length[0]].tolist() == [0, 1] and acc.bonus.tolist() == [5]
    logits = torch.nn.functional.one_hot(torch.tensor([2, 5, 6]), 10).float()
    acc = greedy_accept(logits, tokens, tree.retrieve_indices)
    assert int(acc.length[0]) == 1 and acc.bonus.tolist() == [2]


# ------------------------------------------------------------------------- HF warper semantics


def test_top_p_hand_checked():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # ascending cumsum 0.05, 0.2, 0.5, 1.0; remove <= 0.2 -> keep {0.5, 0.3}
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0, 0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p smaller than the largest probability keeps exactly one token
    torch.testing.assert_close(sampling_probs(logits, 1.0, 0, 0.1), torch.tensor([1.0, 0, 0, 0]))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.6), (0.5, 4, 0.9)])
def test_sampling_probs_match_reference(temperature, top_k, top_p):
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    got = sampling_probs(logits, temperature, top_k, top_p)
    for row in range(5):
        torch.testing.assert_close(got[row].double(), reference_probs(logits[row], temperature, top_k, top_p))


def test_top_k_keeps_ties():
    logits = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert (sampling_probs(logits, 1.0, 1, 1.0) > 0).tolist() == [False, True, True, False]


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(-0.1, 0, 1.0), (1.0, -1, 1.0), (1.0, 2.5, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5)]
)
def test_bad_sampling_params(temperature, top_k, top_p):
    with pytest.raises(ValueError):
        check_sampling_params(temperature, top_k, top_p)


# ------------------------------------------------------------------------- statistical tests

VOCAB = 6
TRIALS = 60_000
#        0
#     /  |  \
#    1   2   3          tokens 1, 2, 4
#   / \   \
#  4   5   6            tokens 0, 3 | 3
#  |
#  7                    token 5
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
TREE_TOKENS = torch.tensor([0, 1, 2, 4, 0, 3, 3, 5])


def _node_laws(seed: int) -> torch.Tensor:
    """A fixed target law per node (N, V), with one token filtered out (prob 0) at some nodes."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(TREE_PARENTS), VOCAB, generator=gen) * 1.2
    for child, parent in enumerate(TREE_PARENTS[1:], start=1):
        logits[parent, TREE_TOKENS[child]] += 2.0  # make drafted tokens likely so deep nodes are reached
    probs = sampling_probs(logits, 0.9, 4, 1.0)  # top-4: some drafts have probability 0
    return probs


def _check_lossless(accept, probs: torch.Tensor, tokens: torch.Tensor, min_count: int = 400) -> float:
    """Run ``accept`` over TRIALS and return the smallest per-node chi-square p-value."""
    torch.manual_seed(1)
    out = accept(probs[None].expand(TRIALS, -1, -1), tokens[None].expand(TRIALS, -1))
    nodes, length, bonus = out.nodes, out.length, out.bonus
    pvalues, tested = [], 0
    for u in range(probs.shape[0]):
        on_path = (nodes == u).any(dim=1)
        # The token emitted right after u: the next accepted node's token, or the bonus.
        pos = (nodes == u).int().argmax(dim=1)
        nxt_node = nodes.gather(1, (pos + 1).clamp(max=nodes.shape[1] - 1)[:, None]).squeeze(1)
        ends_here = pos + 1 >= length
        nxt = torch.where(ends_here, bonus, tokens[nxt_node.clamp(min=0)])
        if int(on_path.sum()) < min_count:
            continue
        tested += 1
        counts = torch.bincount(nxt[on_path], minlength=VOCAB)
        pvalues.append(chi_square_pvalue(counts, probs[u]))
    assert tested >= 5, "the test should reach most tree nodes"
    return min(pvalues)


def test_tree_sampling_is_lossless():
    probs = _node_laws(0)
    children = tree_from_parents(TREE_PARENTS).children

    def accept(p, tok):
        return tree_sample_accept(p, tok, children)

    assert _check_lossless(accept, probs, TREE_TOKENS) > 1e-3


def test_tree_sampling_reaches_deep_nodes():
    probs = _node_laws(0)
    out = tree_sample_accept(probs[None].expand(20_000, -1, -1), TREE_TOKENS[None].expand(20_000, -1),
                             tree_from_parents(TREE_PARENTS).children)
    assert int(out.length.max()) == 4  # root + 3 accepted drafts along 0-1-4-7
    assert (out.length == 1).any() and (out.length >= 3).float().mean() > 0.05


def _broken_tree_accept(p, tok, children):
    """Bug under test: on rejection, the next sibling and the residual still use the original p."""
    bsz = p.shape[0]
    rows = torch.arange(bsz)
    cur = torch.zeros(bsz, dtype=torch.long)
    active = torch.ones(bsz, dtype=torch.bool)
    nodes = torch.full((bsz, p.shape[1] + 1), -1)
    nodes[:, 0] = 0
    length = torch.ones(bsz, dtype=torch.long)
    bonus = torch.zeros(bsz, dtype=torch.long)
    for depth in range(p.shape[1]):
        law = p[rows, cur]
        accepted = torch.zeros_like(active)
        for c in range(children.shape[1]):
            child = children[cur, c]
            trying = active & ~accepted & (child >= 0)
            x = tok[rows, child.clamp(min=0)]
            ok = trying & (torch.rand(bsz) < law.gather(1, x[:, None]).squeeze(1))
            cur = torch.where(ok, child, cur)
            accepted |= ok
        stop = active & ~accepted
        if stop.any():
            bonus[stop] = torch.multinomial(law[stop], 1).squeeze(1)
        active = accepted
        nodes[:, depth + 1] = torch.where(active, cur, -1)
        length += active.long()
        if not active.any():
            break
    from draftsmith.infer.accept import Accepted

    return Accepted(nodes, length, bonus)


def test_statistical_test_detects_a_broken_rule():
    probs = _node_laws(0)
    children = tree_from_parents(TREE_PARENTS).children
    assert _check_lossless(lambda p, t: _broken_tree_accept(p, t, children), probs, TREE_TOKENS) < 1e-6


def test_chain_sampling_is_lossless():
    """Chain of 2 sampled drafts; p and q at node i depend on the drafted prefix."""
    gen = torch.Generator().manual_seed(5)
    p0 = sampling_probs(torch.randn(VOCAB, generator=gen), 1.0, 0, 0.9)
    p1 = sampling_probs(torch.randn(VOCAB, VOCAB, generator=gen), 0.8, 0, 1.0)  # given x1
    p2 = sampling_probs(torch.randn(VOCAB, VOCAB, VOCAB, generator=gen), 1.0, 3, 1.0)  # given x1, x2
    q0 = torch.randn(VOCAB, generator=gen).softmax(-1)
    q1 = torch.randn(VOCAB, VOCAB, generator=gen).softmax(-1)

    torch.manual_seed(2)
    x1 = torch.multinomial(q0, TRIALS, replacement=True)
    x2 = torch.multinomial(q1[x1], 1).squeeze(1)
    tokens = torch.stack([torch.zeros_like(x1), x1, x2], dim=1)  # (B, 3)
    p = torch.stack([p0.expand(TRIALS, -1), p1[x1], p2[x1, x2]], dim=1)  # (B, 3, V)
    q = torch.stack([q0.expand(TRIALS, -1), q1[x1]], dim=1)  # (B, 2, V)
    out = chain_sample_accept(p, q, tokens)

    first = torch.where(out.length > 1, x1, out.bonus)
    assert chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p0) > 1e-3
    for a in range(VOCAB):  # second token given first = a, when the run continued past a
        sel = (out.length > 1) & (x1 == a)
        if int(sel.sum()) < 400:
            continue
        second = torch.where(out.length[sel] > 2, x2[sel], out.bonus[sel])
        assert chi_square_pvalue(torch.bincount(second, minlength=VOCAB), p1[a]) > 1e-3
        for b in range(VOCAB):  # bonus after two accepted drafts
            sel2 = sel & (out.length > 2) & (x2 == b)
            if int(sel2.sum()) >= 400:
                assert chi_square_pvalue(torch.bincount(out.bonus[sel2], minlength=VOCAB), p2[a, b]) > 1e-3
    # The broken rule "residual = p" (ignoring q) must be caught by the same first-token test.
    torch.manual_seed(2)
    rejected = out.length == 1
    wrong = torch.where(rejected, torch.multinomial(p0, TRIALS, replacement=True), x1)
    assert chi_square_pvalue(torch.bincount(wrong, minlength=VOCAB), p0) < 1e-6


def test_typical_acceptance_is_explicit_and_thresholded():
    tree = tree_from_parents([-1, 0, 1])
    probs = torch.tensor([[0.05, 0.9, 0.05], [0.3, 0.3, 0.4], [1 / 3, 1 / 3, 1 / 3]])
    tokens = torch.tensor([0, 1, 0])
    acc = typical_accept(probs, tokens, tree.retrieve_indices, threshold=0.09, alpha=0.3)
    # p(1 | root) = 0.9 passes; p(0 | node 1) = 0.3 > min(0.09, ...) passes too.
    assert int(acc.length[0]) == 3
    acc = typical_accept(probs, tokens, tree.retrieve_indices, threshold=0.5, alpha=10.0)
    assert int(acc.length[0]) == 2  # 0.3 < 0.5 rejects the second draft
