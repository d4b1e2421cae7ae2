"""An EAGLE head drafting a static tree (``StaticTree``: paths of ranks): one head forward per level over the
level's nodes that have children, each row's nodes attending to its prefix and their explored ancestors.

A node's rank-r child is its law's r-th most likely token (fixed drafts), or, with ``StaticTree(sampled=True)``
at temperature > 0, its r-th draw without replacement from that law (the head's logits through the same
warpers as the target's); the laws then travel with the draft (``Draft.q``), which both lossless rules read.
The shape never depends on the drawn tokens, as the rules' proofs need (docs/traversal.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.infer.drafters.base import Draft, Sampling, StaticTree, root_only, stack_rows
from draftsmith.infer.tree import TreeBuffers, medusa_tree, tree_from_parents


@dataclass(frozen=True)
class StaticPlan:
    """A static tree's drafting order: node i > 0 is the ``ranks[i]``-th child of ``parents[i]``."""

    parents: list[int]
    depths: list[int]
    ranks: list[int]
    expanded: list[list[int]]  # per level l >= 1: the depth-l nodes with children, in node order

    @classmethod
    def of(cls, tree: StaticTree) -> StaticPlan:
        built = medusa_tree(tree.choices)
        parents, depths = built.buffers.parents.tolist(), built.buffers.depths.tolist()
        ranks = built.ranks.tolist()
        inner = sorted({p for p in parents[1:] if p > 0})
        expanded = [[i for i in inner if depths[i] == level] for level in range(1, max(depths))]
        return cls(parents, depths, ranks, expanded)

    def pruned(self, levels: int) -> tuple[list[int], list[int]]:
        """(kept node indices, their parent list re-indexed) of the tree cut to ``levels`` draft levels."""
        kept = [i for i, d in enumerate(self.depths) if d <= levels]
        index = {old: new for new, old in enumerate(kept)}
        return kept, [-1] + [index[self.parents[i]] for i in kept[1:]]


def _children(drafter, logits: Tensor, depth: int, count: int, sampling: Sampling,
              sampled: bool) -> tuple[Tensor, Tensor | None]:
    """(draft-vocab ids (..., count) best first or drawn in order, their law (..., Vd) when drawn; ``depth``: the
    children's draft depth, 0 = the root's)."""
    if not sampled or sampling.greedy:
        return logits.topk(count, dim=-1).indices, None
    law = drafter._sampled_law(logits, sampling, depth)
    flat = law.reshape(-1, law.shape[-1])
    drawn = torch.multinomial(flat, count, replacement=False)  # sequential draws without replacement, in order
    return drawn.reshape(*law.shape[:-1], count), law


def _ancestry(plan: StaticPlan, level: int, entries: list[int]) -> Tensor:
    """(F, E + F) bool: which explored entries (``entries``: node of each, in write order) and new ones each of
    level ``level``'s expanded nodes sees: its ancestors' and its own."""
    nodes = plan.expanded[level - 1]
    allowed = torch.zeros(len(nodes), len(entries) + len(nodes), dtype=torch.bool)
    for f, node in enumerate(nodes):
        up = plan.parents[node]
        while up > 0:
            allowed[f, entries.index(up)] = True
            up = plan.parents[up]
        allowed[f, len(entries) + f] = True
    return allowed


def draft_static_trees(drafter, cache, states: list, roots: list[Tensor], levels: list[int], sampling: Sampling,
                       plan: StaticPlan, sampled: bool) -> list[Draft]:
    """Each row's static tree of ``levels[i]`` levels, drafted together over the rows of ``cache``."""
    depth = min(max(levels), max(plan.depths))
    if depth <= 0:
        return [root_only(r) for r in roots]
    prefix = cache.row_lengths()
    hidden, _ = stack_rows(cache.rows, [s.row for s in states], [s.hidden for s in states])  # (rows, 1, H)
    n, device = len(plan.parents), hidden.device
    tokens = torch.zeros(cache.rows, n, dtype=torch.long, device=device)
    laws: list[Tensor | None] = [None] * n  # per parent node: (rows, V) law of its children, target ids
    outputs = {0: hidden[:, 0]}  # node -> (rows, H) head output at it
    entries: list[int] = []
    try:
        for level in range(1, depth + 1):
            if level > 1:  # the head at the previous level's expanded nodes
                nodes = plan.expanded[level - 2]
                allowed = _ancestry(plan, level - 1, entries).to(device).expand(cache.rows, -1, -1)
                pos = torch.tensor(prefix, device=device)[:, None] + level - 2
                mask = cache.block_mask(prefix, allowed, hidden.dtype)
                parent_out = torch.stack([outputs[plan.parents[i]] for i in nodes], dim=1)  # (rows, F, H)
                out = drafter._step(cache, parent_out, tokens[:, nodes], pos.expand(-1, len(nodes)), mask)
                entries += nodes
                outputs.update({node: out[:, f] for f, node in enumerate(nodes)})
            _fill_level(drafter, plan, level, outputs, tokens, laws, sampling, sampled)
    finally:
        cache.crop_rows(prefix)  # exploration KV is approximate: keep accepted tokens only
    return [_row_draft(plan, root, min(n_levels, depth), tokens[s.row], laws, s.row)
            for s, root, n_levels in zip(states, roots, levels)]


def _fill_level(drafter, plan: StaticPlan, level: int, outputs: dict, tokens: Tensor, laws: list,
                sampling: Sampling, sampled: bool) -> None:
    """The depth-``level`` nodes' tokens (and their parents' laws) from the head outputs at their parents."""
    parents = sorted({plan.parents[i] for i, d in enumerate(plan.depths) if d == level})
    for parent in parents:
        kids = [i for i, p in enumerate(plan.parents) if p == parent and i > 0]
        count = max(plan.ranks[i] for i in kids) + 1
        ids, law = _children(drafter, drafter._logits(outputs[parent]), level - 1, count, sampling, sampled)  # (rows, count)
        for kid in kids:
            tokens[:, kid] = drafter._to_target(ids[:, plan.ranks[kid]])
        if law is not None:
            full = law.new_zeros(law.shape[0], drafter.vocab_size)  # the law over target ids
            full[:, drafter._to_target(torch.arange(law.shape[-1], device=law.device))] = law
            laws[parent] = full


def _row_draft(plan: StaticPlan, root: Tensor, levels: int, tokens: Tensor, laws: list, row: int) -> Draft:
    """One row's draft: the tree cut to ``levels`` levels, its tokens and (sampled) each node's parent's law."""
    if levels <= 0:
        return root_only(root)
    kept, parents = plan.pruned(levels)
    ids = torch.cat([root.reshape(1), tokens[kept[1:]]])
    q = None
    if laws[0] is not None:
        q = torch.stack([laws[plan.parents[i]][row] for i in kept[1:]])  # (N-1, V)
    return Draft(ids, _buffers(tuple(parents), str(root.device)), q)


_BUFFERS: dict[tuple[tuple[int, ...], str], TreeBuffers] = {}


def _buffers(parents: tuple[int, ...], device: str) -> TreeBuffers:
    """Tree buffers per (pruned shape, device), built once (no consumer writes into them)."""
    if (parents, device) not in _BUFFERS:
        _BUFFERS[(parents, device)] = tree_from_parents(list(parents), device)
    return _BUFFERS[(parents, device)]


__all__ = ["StaticPlan", "draft_static_trees"]
