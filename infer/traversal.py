"""Traversal Verification (Weng et al. 2025, arXiv 2505.12398): a draft tree verified sequence by sequence, leaf
to root, losslessly; the proof's steps are in docs/traversal.md.

Every node a carries a weight w_a in [0, 1] (the chance, given the traversal reached it, that the accepted path
goes through it), the target's residual law P_a (its next token) and, for sampled trees, the draft law Q_a its
children were drawn from without replacement, in order (deterministic drafts: child y's law is one-hot on y).
The root starts at w = 1, P = the target's law. Walking the tree depth first:
- entering child c (token y) of node b: w_c = min(1, w_b P_b(y) / Q_b(y)), P_c = the target's law at c;
- leaving c (its whole subtree rejected): accept c with probability w_c (the path root..c is kept, the bonus
  token is drawn from P_c); else c is rejected and its parent b's laws become the rest of the sequence-level
  residual: R = max(0, w_b P_b - Q_b), P_b = R / sum(R), w_b = sum(R) / (1 - w_b + sum(R)), and (sampled
  trees) y leaves Q_b, renormalised.
The root, left last, has w = 1 whenever it is reached. On a chain this is Block Verification (Sun et al. 2024);
at the root (w = 1) a level is the token-level rule of ``infer.accept``. With deterministic drafts its mean τ
equals that rule's (both reach every node with the target's probability of its path, the most any lossless rule
can); sampled trees (``StaticTree(sampled=True)``) are where it accepts more.
"""
from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.infer.accept import Accepted
from draftsmith.infer.tree import TreeBuffers


def _walk(parents: list[int]) -> list[tuple[int, bool]]:
    """(node, entering) for every non-root node, depth first, children in node order: enter, subtree, leave."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    events: list[tuple[int, bool]] = []
    stack = [(c, True) for c in reversed(kids[0])]
    while stack:
        node, entering = stack.pop()
        events.append((node, entering))
        if entering:
            stack.append((node, False))
            stack.extend((c, True) for c in reversed(kids[node]))
    return events


def _node_laws(q: Tensor, parents: list[int]) -> Tensor:
    """Per-child draft laws (B, N-1, V) as each node's law for its children (B, N, V); leaves keep zeros."""
    laws = q.new_zeros(q.shape[0], len(parents), q.shape[-1])
    laws[:, parents[1:]] = q  # siblings carry one law: any of them writes it
    return laws


def _reject(w: Tensor, p: Tensor, q: Tensor | None, parent: int, y: Tensor, rows: Tensor) -> None:
    """Rows ``rows`` rejected the subtree of their child with token y (B,) under ``parent``: its residual, in place."""
    wb, pb = w[:, parent], p[:, parent]
    law = torch.nn.functional.one_hot(y, pb.shape[-1]).to(pb.dtype) if q is None else q[:, parent]
    residual = (wb[:, None] * pb - law).clamp(min=0)  # (B, V)
    mass = residual.sum(dim=1)
    rest = 1 - wb + mass
    # mass 0 or rest 0: a rejection of probability 0 (rounding); the laws stay as they are
    p[:, parent] = torch.where((rows & (mass > 0))[:, None], residual / mass.clamp(min=1e-30)[:, None], pb)
    w[:, parent] = torch.where(rows & (rest > 0), mass / rest.clamp(min=1e-30), wb)
    if q is not None:
        left = q[:, parent].scatter(1, y[:, None], 0.0)
        total = left.sum(dim=1, keepdim=True)
        q[:, parent] = torch.where(rows[:, None] & (total > 0), left / total.clamp(min=1e-30), q[:, parent])


def traversal_accept(
    probs: Tensor,  # (B, N, V) target probabilities at every node (after warpers)
    tokens: Tensor,  # (B, N) node tokens (tokens[:, 0] = root, unused)
    tree: TreeBuffers,  # the draft's structure, shared by the B rows
    q: Tensor | None = None,  # (B, N-1, V) law node i's sibling set was drawn from; None = deterministic drafts
    generator: torch.Generator | None = None,
) -> Accepted:
    """Lossless Traversal Verification of one draft tree, B independent trials at once (see the module docstring)."""
    bsz, n, _ = probs.shape
    device = probs.device
    parents = tree.parents.tolist()  # sync: the walk's order is the host's
    p = probs.float().clone()
    laws = None if q is None else _node_laws(q.float(), parents)
    w = torch.zeros(bsz, n, device=device)
    w[:, 0] = 1.0
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    last = torch.zeros(bsz, dtype=torch.long, device=device)  # the accepted path's end (root: none kept)
    for node, entering in _walk(parents):
        b, y = parents[node], tokens[:, node]
        if entering:
            px = p[:, b].gather(1, y[:, None])[:, 0]
            qx = torch.ones_like(px) if laws is None else laws[:, b].gather(1, y[:, None])[:, 0]
            w[:, node] = torch.where(qx > 0, (w[:, b] * px / qx.clamp(min=1e-30)).clamp(max=1.0), 0.0)
            continue
        u = torch.rand(bsz, generator=generator, device=device)
        kept = ~done & (u < w[:, node])
        last = torch.where(kept, node, last)
        done |= kept
        _reject(w, p, laws, b, y, ~done)
        if bool(done.all()):  # sync: every trial has its path
            break
    rows = torch.arange(bsz, device=device)
    bonus = torch.multinomial(p[rows, last], 1, generator=generator)[:, 0]
    paths = _paths(tree, device)
    length = tree.depths.to(device)[last] + 1
    nodes = paths[last][:, : int(length.max())]  # sync
    return Accepted(nodes=nodes, length=length, bonus=bonus)


def _paths(tree: TreeBuffers, device: torch.device) -> Tensor:
    """(N, D+1) each node's root-to-node path, padded with -1."""
    depth = int(tree.depths.max()) + 1  # sync
    parents = tree.parents.tolist()
    rows = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        rows.append(path[::-1] + [-1] * (depth - len(path)))
    return torch.tensor(rows, dtype=torch.long, device=device)


__all__ = ["traversal_accept"]
