"""infer.tree: buffers on hand-checkable trees, Medusa choices, EAGLE-2 rerank, tree verification."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.target.model import target_forward
from draftsmith.infer.tree import (
    MEDUSA_DEFAULT_CHOICES,
    Candidates,
    expand_level,
    medusa_tree,
    select_trees,
    tree_attention_mask,
    tree_from_parents,
)


def select_tree(candidates: Candidates, num_drafts: int) -> tuple[torch.Tensor, list[int]]:
    """One row of ``select_trees`` over all of its candidates: (chosen indices, parent list)."""
    rows = Candidates(candidates.tokens[None], candidates.scores[None], candidates.parents[None])
    chosen, parents = select_trees(rows, num_drafts, [candidates.scores.shape[0]])
    return chosen[0], parents[0]


#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def test_tree_from_parents_hand_checked():
    t = tree_from_parents(PARENTS)
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    expected_rows = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    for i, row in expected_rows.items():
        assert set(t.mask[i].nonzero().flatten().tolist()) == row
    assert t.retrieve_indices.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]  # leaves in node order
    assert t.children.tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert t.num_nodes == 7


def test_chain_and_root_only():
    t = tree_from_parents([-1, 0, 1, 2])
    assert t.mask.tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    assert t.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    root = tree_from_parents([-1])
    assert root.retrieve_indices.tolist() == [[0]] and root.children.tolist() == [[-1]]


@pytest.mark.parametrize(
    "parents, message",
    [([], "root"), ([0, 0], "root"), ([-1, 2, 0], "before"), ([-1, 0, 1, 0], "depth order")],
)
def test_bad_parent_lists(parents, message):
    with pytest.raises(ValueError, match=message):
        tree_from_parents(parents)


def test_medusa_tree_from_choices():
    tree = medusa_tree([[1, 0], [0], [0, 1], [1], [0, 0]])
    # Sorted by (depth, path): (0,) (1,) (0,0) (0,1) (1,0)
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.buffers.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.ranks.tolist() == [-1, 0, 1, 0, 1, 0]
    assert tree.depth == 2
    with pytest.raises(ValueError, match="no parent"):
        medusa_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match="duplicate"):
        medusa_tree([[0], [0]])


def test_default_medusa_tree():
    tree = medusa_tree(MEDUSA_DEFAULT_CHOICES)
    assert tree.buffers.num_nodes == 64 and tree.depth == 4
    assert int(tree.ranks.max()) == 9
    # Every node's rank is distinct among its siblings (siblings draft distinct tokens).
    for row in tree.buffers.children.tolist():
        kids = [c for c in row if c >= 0]
        assert len({int(tree.ranks[c]) for c in kids}) == len(kids)


def test_tree_attention_mask_values():
    t = tree_from_parents(PARENTS)
    mask = tree_attention_mask(t.mask, prefix_len=3, dtype=torch.float32)
    assert mask.shape == (1, 1, 7, 10)
    assert (mask[..., :3] == 0).all()
    blocked = torch.finfo(torch.float32).min
    assert torch.equal(mask[0, 0, :, 3:] == 0, t.mask)
    assert (mask[0, 0, :, 3:][~t.mask] == blocked).all()


def test_expand_level_hand_checked():
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]))
    tokens, scores, slots, frontier = expand_level(torch.log(torch.tensor([1.0, 0.5])), logp, top_k=2)
    assert tokens.tolist() == [0, 1, 1, 2]
    assert slots.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(scores.exp(), torch.tensor([0.5, 0.3, 0.3, 0.15]))
    assert sorted(frontier.tolist()) == [0, 1] or sorted(frontier.tolist()) == [0, 2]  # 0.3 tie


def test_select_tree_keeps_parents_on_ties():
    # Candidate 2 is a child of 0 with the same score (log-prob 0): a budget of 1 must keep the parent.
    cands = Candidates(
        tokens=torch.tensor([5, 6, 7, 8]),
        scores=torch.tensor([-0.5, -1.0, -0.5, -2.0]),
        parents=torch.tensor([-1, -1, 0, 2]),
    )
    chosen, parents = select_tree(cands, 1)
    assert chosen.tolist() == [0] and parents == [-1, 0]
    chosen, parents = select_tree(cands, 3)
    assert chosen.tolist() == [0, 1, 2] and parents == [-1, 0, 0, 1]
    chosen, parents = select_tree(cands, 10)
    assert chosen.tolist() == [0, 1, 2, 3] and parents == [-1, 0, 0, 1, 3]
    tree_from_parents(parents)  # valid depth order


def test_dynamic_expansion_matches_brute_force():
    """Two levels over a fixed draft distribution: the kept nodes are the best-scoring paths."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 6, 3
    logp0 = torch.randn(1, vocab, generator=gen).log_softmax(-1)
    logp1 = torch.randn(vocab, vocab, generator=gen).log_softmax(-1)  # next-token law given a token
    tok0, sc0, _, front = expand_level(torch.zeros(1), logp0, k)
    tok1, sc1, slots, _ = expand_level(sc0[front], logp1[tok0[front]], k)
    cands = Candidates(torch.cat([tok0, tok1]), torch.cat([sc0, sc1]), torch.cat([torch.full((k,), -1), front[slots]]))
    chosen, parents = select_tree(cands, 5)
    tree = tree_from_parents(parents)
    # Brute force over every 1- and 2-token path reachable through the same frontier.
    paths = {(int(t),): float(logp0[0, t]) for t in tok0}
    for t in tok0[front]:
        for u in logp1[t].topk(k).indices:
            paths[(int(t), int(u))] = float(logp0[0, t] + logp1[t, u])
    best = sorted(paths.values(), reverse=True)[:5]
    torch.testing.assert_close(cands.scores[chosen].sort(descending=True).values, torch.tensor(best))
    node_tokens = [None] + cands.tokens[chosen].tolist()
    for i in range(1, tree.num_nodes):  # every node spells a scored path, with its own score
        path, j = [], i
        while j > 0:
            path.insert(0, node_tokens[j])
            j = parents[j]
        assert paths[tuple(path)] == pytest.approx(float(cands.scores[chosen[i - 1]]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_equals_path_forwards(attn):
    """Each node's logits from one tree forward equal a plain forward over prefix + its path."""
    model = make_tiny_target("llama", attn_implementation=attn, dtype=torch.float64)
    prefix = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([11, 12, 13, 14, 15, 16, 17])
    tree = tree_from_parents(PARENTS)
    with torch.no_grad():
        pre = target_forward(model, prefix, use_cache=True)
        out = target_forward(
            model,
            tokens[None],
            attention_mask=tree_attention_mask(tree.mask, 5, model.dtype),
            position_ids=(5 + tree.depths)[None],
            past_key_values=pre.past_key_values,
        )
        for node in range(tree.num_nodes):
            path = tree.mask[node].nonzero().flatten()
            full = model(torch.cat([prefix, tokens[path][None]], dim=1)).logits[0, -1]
            # float64 weights, but HF computes RoPE's cos/sin in float32: a position's angle can round
            # one float32 ulp apart (~6e-8 relative) between the two forwards' shapes and the CPU's
            # vector kernels (AVX2 gave 8.4e-9 absolute). A wrong mask or position moves logits by ~1e-1.
            torch.testing.assert_close(out.logits[0, node], full, rtol=1e-6, atol=1e-6)
