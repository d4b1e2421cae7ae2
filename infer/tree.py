"""Tree buffers: pure tensor helpers shared by every drafter.

A draft tree has N nodes in depth order with the root (the last emitted token, not yet in the
target's KV cache) at index 0; ``parents[i] < i`` for every other node. Node i sits at position
``prefix_len + depth[i]`` and attends to the prefix plus its ancestors and itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from draftsmith.heads.layers import additive_mask

# mc_sim_7b_63 from the Medusa repository (medusa/model/medusa_choices.py): 63 non-root nodes,
# depth 4, built greedily from measured per-head top-k accuracies of Vicuna-7B heads.
# Path (0, 1) = head 0's top-1 token, then head 1's top-2 token.
MEDUSA_DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)


@dataclass(frozen=True)
class TreeBuffers:
    """Static structure of one draft tree (all tensors on one device)."""

    parents: Tensor  # (N,) long; parents[0] = -1
    depths: Tensor  # (N,) long; depths[0] = 0
    mask: Tensor  # (N, N) bool; mask[i, j] = node j is node i or one of its ancestors
    retrieve_indices: Tensor  # (P, D+1) long; root->leaf node paths, padded with -1
    children: Tensor  # (N, C) long; children of each node in node order, padded with -1

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    def to(self, device: torch.device | str) -> TreeBuffers:
        return TreeBuffers(*(t.to(device) for t in (self.parents, self.depths, self.mask,
                                                     self.retrieve_indices, self.children)))


def tree_from_parents(parents: Sequence[int] | Tensor, device: torch.device | str | None = None) -> TreeBuffers:
    """Tree buffers for nodes in depth order given by their parent indices (root first, -1)."""
    par = [int(p) for p in (parents.tolist() if isinstance(parents, Tensor) else parents)]  # sync
    n = len(par)
    if n == 0 or par[0] != -1:
        raise ValueError("a tree needs a root at index 0 with parent -1")
    depths = [0] * n
    for i in range(1, n):
        if not 0 <= par[i] < i:
            raise ValueError(f"node {i} has parent {par[i]}; parents must come before their children")
        depths[i] = depths[par[i]] + 1
        if depths[i] < depths[i - 1]:
            raise ValueError(f"node {i} (depth {depths[i]}) follows a deeper node: nodes must be in depth order")

    # Plain Python lists, then one tensor each: cheap enough to rebuild every step (EAGLE-2).
    paths: list[list[int]] = [[0]]  # root-to-node path of every node; mask[i] = mask[parent(i)] | {i}
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        paths.append(paths[par[i]] + [i])
        kids[par[i]].append(i)
    rows = [i for i, path in enumerate(paths) for _ in path]
    cols = [j for path in paths for j in path]
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[rows, cols] = True

    width = max(1, max(len(k) for k in kids))
    children = torch.tensor([k + [-1] * (width - len(k)) for k in kids], dtype=torch.long)
    depth = max(depths) + 1
    leaves = [i for i in range(n) if not kids[i]]
    retrieve = torch.tensor([paths[i] + [-1] * (depth - len(paths[i])) for i in leaves], dtype=torch.long)

    buffers = TreeBuffers(
        parents=torch.tensor(par, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        mask=mask,
        retrieve_indices=retrieve,
        children=children,
    )
    return buffers if device is None else buffers.to(device)


def chain_parents(num_drafts: int) -> list[int]:
    """Parent list of a chain: root then ``num_drafts`` nodes, each the child of the previous."""
    return [-1] + list(range(num_drafts))


@dataclass(frozen=True)
class MedusaTree:
    """A static tree from Medusa choices: node i > 0 holds the ``ranks[i]``-th most likely token
    of head ``depths[i] - 1``."""

    buffers: TreeBuffers
    ranks: Tensor  # (N,) long; ranks[0] = -1 (root)
    choices: tuple[tuple[int, ...], ...]  # depth-sorted paths; node i + 1 = choices[i]

    @property
    def depth(self) -> int:
        """Number of draft levels (Medusa heads used)."""
        return int(self.buffers.depths.max())  # sync


def medusa_tree(choices: Sequence[Sequence[int]], device: torch.device | str | None = None) -> MedusaTree:
    """Build a static tree from Medusa paths (``[0, 1]`` = head-0 top-1, then head-1 top-2).

    Every prefix of every path must be present; duplicates are errors.
    """
    paths = sorted({tuple(int(c) for c in p) for p in choices}, key=lambda p: (len(p), p))
    if len(paths) != len(choices):
        raise ValueError("Medusa choices contain duplicate paths")
    if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
        raise ValueError("Medusa choices must be non-empty paths of non-negative ranks")
    index = {(): 0}
    parents, ranks = [-1], [-1]
    for i, p in enumerate(paths, start=1):
        if p[:-1] not in index:
            raise ValueError(f"Medusa choice {list(p)} has no parent path {list(p[:-1])}")
        index[p] = i
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    buffers = tree_from_parents(parents, device)
    return MedusaTree(buffers, torch.tensor(ranks, dtype=torch.long, device=device), tuple(paths))


def tree_attention_mask(tree_mask: Tensor, prefix_len: int, dtype: torch.dtype) -> Tensor:
    """Additive float mask (1, 1, Q, prefix_len + K) for a bool block ``tree_mask`` (Q, K): the
    prefix is visible to every query, the block after it is ``tree_mask`` (usually the (N, N)
    tree mask); 0 = attend, finfo(dtype).min = blocked."""
    q_len = tree_mask.shape[0]
    allowed = torch.cat(
        [torch.ones(q_len, prefix_len, dtype=torch.bool, device=tree_mask.device), tree_mask], dim=1
    )  # (Q, S + K)
    return additive_mask(allowed, dtype)


@dataclass
class Candidates:
    """Every node scored during an EAGLE-2 expansion, in creation (= depth) order."""

    tokens: Tensor  # (M,) long, target ids
    scores: Tensor  # (M,) cumulative draft log-prob of the path ending at the node
    parents: Tensor  # (M,) long, index into the candidates, -1 for children of the root


def expand_level(
    frontier_scores: Tensor,  # (..., F) cumulative log-probs of the frontier nodes
    child_logprobs: Tensor,  # (..., F, V) draft log-probs of each frontier node's next token
    top_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One EAGLE-2 level: the top_k children of each frontier node (F·top_k candidates) and the
    best top_k of them as the next frontier; leading dims (a batch's rows) expand independently.

    Returns (child_tokens (..., F·k), child_scores (..., F·k), child_parent_slot (..., F·k) in
    0..F-1, next_frontier (..., k) indices into the children), children ordered by parent then rank.
    """
    # Clamp so a child never outscores its parent, even if log_softmax rounds above 0.
    k = min(top_k, child_logprobs.shape[-1])
    logp, tokens = child_logprobs.clamp(max=0).topk(k, dim=-1)  # (..., F, k)
    scores = frontier_scores[..., None] + logp  # (..., F, k)
    slots = torch.arange(scores.shape[-2], device=scores.device)[:, None].expand_as(scores)
    scores, tokens, slots = scores.flatten(-2), tokens.flatten(-2), slots.flatten(-2)
    next_frontier = scores.topk(min(top_k, scores.shape[-1]), dim=-1).indices
    return tokens, scores, slots, next_frontier


def select_trees(candidates: Candidates, num_drafts: int, sizes: list[int]) -> tuple[list[Tensor], list[list[int]]]:
    """Keep the ``num_drafts`` best candidates of each row of (rows, M) candidates as a tree in depth order, row b
    over its first ``sizes[b]`` (the rest, created later, are ignored): one host read for every row.

    Returns per row (chosen candidate indices in creation order, parent list for ``tree_from_parents`` with the
    root prepended). Ties: a stable descending sort puts a parent (created earlier) before an equally scored
    child, so the kept set is closed under parents.
    """
    scores, m = candidates.scores, candidates.scores.shape[-1]
    count = torch.tensor(sizes, device=scores.device)[:, None]  # (rows, 1)
    column = torch.arange(m, device=scores.device)
    scores = scores.masked_fill(column >= count, float("-inf"))  # ignored ones sort after every kept one
    n = min(num_drafts, m)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n]  # (rows, n)
    taken = torch.arange(n, device=scores.device) < count.clamp(max=num_drafts)  # (rows, n)
    chosen = torch.where(taken, order, m).sort(dim=-1).values  # creation order is depth order; m = none
    parent_cand = candidates.parents.gather(1, chosen.clamp(max=m - 1))
    host_chosen, host_parents = torch.stack([chosen, parent_cand]).tolist()  # sync: one for every row
    chosen_rows, parent_rows = [], []
    for b, size in enumerate(sizes):
        kept = min(num_drafts, size)
        position = {c: i + 1 for i, c in enumerate(host_chosen[b][:kept])}  # candidate -> node index
        position[-1] = 0
        missing = [p for p in host_parents[b][:kept] if p not in position]
        if missing:
            raise RuntimeError(f"selected draft nodes lost their parents {missing}: scores are not monotone")
        chosen_rows.append(chosen[b, :kept])
        parent_rows.append([-1] + [position[p] for p in host_parents[b][:kept]])
    return chosen_rows, parent_rows


def pad_tree(tokens: Tensor, depths: Tensor, mask: Tensor, budget: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pad a tree of n nodes to ``budget`` nodes so every verify has one shape.

    Dummy nodes hold token 0 at depth 0 and see only the prefix and themselves; no real node sees
    them, so the real nodes' logits are unchanged, and theirs are never read (acceptance looks at
    the first n). Returns tokens (N,), depths (N,), mask (N, N) bool.
    """
    n = tokens.shape[0]
    if n == budget:
        return tokens, depths, mask
    if n > budget:
        raise ValueError(f"a draft of {n} nodes exceeds the tree budget of {budget}")
    pad = budget - n
    full = torch.eye(budget, dtype=torch.bool, device=mask.device)
    full[:n, :n] = mask
    return torch.cat([tokens, tokens.new_zeros(pad)]), torch.cat([depths, depths.new_zeros(pad)]), full
