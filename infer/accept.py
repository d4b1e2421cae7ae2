"""Acceptance rules: which drafted tokens the target keeps, and the bonus token after them.

All rules return an ``Accepted`` batch; generation calls them once per row, the statistical tests run many
independent trials at once through the same functions.

Lossless rules (the emitted tokens are distributed exactly as the target's own decoding):
- greedy: a node is kept when its token equals the target's argmax at its parent.
- tree with deterministic drafts (EAGLE-2/3 top-k trees, Medusa): at each depth try the distinct
  children of the accepted node in order; accept child x with probability p(x) / sum(p); on
  rejection set p(x) = 0 and try the next sibling; if none is accepted, sample from what is left
  of p. (Each draft is a one-hot q, so this is the min(1, p/q) rule with residual max(0, p - q).)
- chain with sampled drafts x_i ~ q_i: accept with probability min(1, p(x)/q(x)); on rejection
  sample from norm(max(0, p - q)).
- tree with sampled drafts (each node's children drawn from q without replacement, in order): the same per
  sibling, then p = norm(max(0, p - q)) and x leaves q (renormalised) before the next sibling (SpecInfer's
  rule without replacement). ``infer.traversal`` verifies either tree sequence by sequence instead.
If every draft on the path is accepted, the bonus token is sampled from p at the last node.

``p`` is the target's distribution after HF's sampling warpers, in HF's order: temperature,
then top-k, then top-p (``transformers.generation.utils._get_logits_processor``), computed on
float32 logits like HF's sampling loop. Medusa's typical acceptance is lossy and opt-in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass
class Accepted:
    """Outcome of one verification (batched over independent trials)."""

    nodes: Tensor  # (B, D+1) long; accepted node indices, root first, padded with -1
    length: Tensor  # (B,) long; accepted nodes including the root (>= 1)
    bonus: Tensor  # (B,) long; token emitted after the last accepted node


def check_sampling_params(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError for values HF's ``generate`` would also reject (0 temperature = greedy)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a float >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = disabled), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {top_p!r}")


def sampling_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Target probabilities (..., V) in float32 exactly as HF's ``generate(do_sample=True)``.

    HF's warpers are used directly (not re-implemented) so top-k ties and top-p's
    ``min_tokens_to_keep=1`` behave identically.
    """
    shape = logits.shape
    scores = logits.reshape(-1, shape[-1]).float()  # (R, V) as HF: logits cast to float32
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1)(None, scores)
    return scores.softmax(dim=-1).reshape(shape)


def greedy_accept_rows(logits: Tensor, tokens: Tensor, retrieve_indices: Tensor) -> Accepted:
    """Each row's longest root-to-leaf path whose tokens equal the target's argmax at their parents, for B rows
    at once, on the device (no host sync): logits (B, N, V), tokens (B, N), retrieve_indices (B, P, D+1) padded
    with -1 (a row with fewer paths or levels pads them). Ties between equally long paths go to the first path."""
    bsz, paths, width = retrieve_indices.shape
    target = logits.float().argmax(dim=-1)  # (B, N) argmax on float32 logits, as HF's greedy loop
    valid = retrieve_indices >= 0  # (B, P, D+1)
    idx = retrieve_indices.clamp(min=0).flatten(1)  # (B, P·(D+1))
    draft = tokens.gather(1, idx).view(bsz, paths, width)
    predicted = target.gather(1, idx).view(bsz, paths, width)  # the target's choice after each node
    match = (draft[..., 1:] == predicted[..., :-1]) & valid[..., 1:]  # (B, P, D)
    run = match.long().cumprod(dim=2).sum(dim=2)  # (B, P) accepted drafts per path
    best = run.argmax(dim=1)  # (B,) first maximal path
    length = run.gather(1, best[:, None])[:, 0] + 1  # (B,)
    keep = torch.arange(width, device=tokens.device)[None] < length[:, None]  # (B, D+1)
    chosen = retrieve_indices.gather(1, best[:, None, None].expand(-1, 1, width))[:, 0]  # (B, D+1)
    nodes = torch.where(keep, chosen, -1)
    bonus = target.gather(1, nodes.gather(1, (length - 1)[:, None]))[:, 0]
    return Accepted(nodes=nodes, length=length, bonus=bonus)


def _gather_token_probs(probs: Tensor, tokens: Tensor) -> Tensor:
    return probs.gather(1, tokens[:, None]).squeeze(1)


def categorical(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of non-negative, not necessarily normalised weights (..., V), each row's sum > 0: the first
    index whose cumulative weight (float64) reaches u * the row's sum, u uniform in (0, 1]. The same law as
    ``torch.multinomial(weights, 1)`` (a weight of 0 is never drawn: u > 0 and u * sum <= sum), at a sixth of its
    cost on a CPU (80 us for 4096 ids there, where a demo decode step takes 3 ms), from another random stream."""
    cdf = weights.double().cumsum(dim=-1)
    u = 1.0 - torch.rand((*cdf.shape[:-1], 1), generator=generator, dtype=cdf.dtype, device=cdf.device)  # (0, 1]
    return torch.searchsorted(cdf, u * cdf[..., -1:]).squeeze(-1)


def _sample_rows(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row of non-negative, not necessarily normalised weights (R, V)."""
    return categorical(weights, generator)


def tree_sample_accept(
    probs: Tensor,  # (B, N, V) target probabilities at every node (after warpers)
    tokens: Tensor,  # (B, N) node tokens (tokens[:, 0] = root, unused)
    children: Tensor,  # (N, C) children of each node in order, padded with -1
    generator: torch.Generator | None = None,
    q: Tensor | None = None,  # (B, N, V) law each node's children were drawn from without replacement; None: fixed
) -> Accepted:
    """Lossless token-level acceptance for a tree of deterministic drafts or (``q``) of sampled ones (see the
    module docstring)."""
    bsz, n, vocab = probs.shape
    device = probs.device
    rows = torch.arange(bsz, device=device)
    vocab_ids = torch.arange(vocab, device=device)
    cur = torch.zeros(bsz, dtype=torch.long, device=device)  # current accepted node
    active = torch.ones(bsz, dtype=torch.bool, device=device)
    nodes = torch.full((bsz, n + 1), -1, dtype=torch.long, device=device)  # one spare column
    nodes[:, 0] = 0
    length = torch.ones(bsz, dtype=torch.long, device=device)
    bonus = torch.zeros(bsz, dtype=torch.long, device=device)
    for depth in range(n):
        p = probs[rows, cur].clone()  # (B, V) residual of the current node, unnormalised
        law = None if q is None else q[rows, cur].clone()  # (B, V) what is left of the draft law there
        accepted = torch.zeros_like(active)
        for c in range(children.shape[1]):
            child = children[cur, c]  # (B,)
            trying = active & ~accepted & (child >= 0)
            if not bool(trying.any()):  # sync: stop once no trial has a sibling left
                break
            x = tokens[rows, child.clamp(min=0)]  # (B,)
            px = _gather_token_probs(p, x)
            u = torch.rand(bsz, generator=generator, device=device)
            if law is None:
                ok = trying & (u * p.sum(dim=1) < px)  # u < p(x) / sum(p)
            else:  # u < (p(x) / sum(p)) / (q(x) / sum(q))
                ok = trying & (u * p.sum(dim=1) * _gather_token_probs(law, x) < px * law.sum(dim=1))
            cur = torch.where(ok, child, cur)
            accepted |= ok
            rejected = trying & ~ok
            drop = rejected[:, None] & (vocab_ids == x[:, None])
            if law is not None:  # p = max(0, p - q) (both normalised); x leaves q
                residual = (p / p.sum(dim=1, keepdim=True) - law / law.sum(dim=1, keepdim=True)).clamp(min=0)
                keep = rejected[:, None] & (residual.sum(dim=1, keepdim=True) > 0)  # else a rejection of chance 0
                p = torch.where(keep, residual, p)
                law.masked_fill_(drop, 0.0)
            # p(x) = 0; the next sibling sees the renormalised rest (masked_fill: no index_put sync)
            p.masked_fill_(drop, 0.0)
        stop = active & ~accepted
        if bool(stop.any()):  # sync
            bonus[stop] = _sample_rows(p[stop], generator)
        active = accepted
        nodes[:, depth + 1 : depth + 2] = torch.where(active, cur, -1)[:, None]
        length += active.long()
        if not bool(active.any()):  # sync
            break
    width = int(length.max())  # sync
    return Accepted(nodes=nodes[:, :width], length=length, bonus=bonus)


def chain_sample_accept(
    p: Tensor,  # (B, N, V) target probabilities at every chain node (after warpers)
    q: Tensor,  # (B, N-1, V) draft distribution node i+1 was sampled from
    tokens: Tensor,  # (B, N) chain tokens; tokens[:, i+1] ~ q[:, i]
    generator: torch.Generator | None = None,
) -> Accepted:
    """Lossless speculative sampling for a chain of sampled drafts (min(1, p/q), residual)."""
    bsz, n, _ = p.shape
    device = p.device
    active = torch.ones(bsz, dtype=torch.bool, device=device)
    length = torch.ones(bsz, dtype=torch.long, device=device)
    bonus = torch.zeros(bsz, dtype=torch.long, device=device)
    for i in range(n - 1):
        x = tokens[:, i + 1]
        px, qx = _gather_token_probs(p[:, i], x), _gather_token_probs(q[:, i], x)
        u = torch.rand(bsz, generator=generator, device=device)
        ok = active & (u * qx < px)  # u < p(x) / q(x)
        stop = active & ~ok
        if bool(stop.any()):  # sync
            residual = (p[stop, i] - q[stop, i]).clamp(min=0)  # (R, V)
            # p == q up to rounding leaves no residual mass; then p itself is the right law.
            empty = residual.sum(dim=1, keepdim=True) <= 0
            bonus[stop] = _sample_rows(torch.where(empty, p[stop, i], residual), generator)
        active = ok
        length += active.long()
        if not bool(active.any()):  # sync
            break
    if bool(active.any()):  # sync: every draft accepted, the bonus comes from the last node
        bonus[active] = _sample_rows(p[active, n - 1], generator)
    pos = torch.arange(n, device=device)
    nodes = torch.where(pos[None] < length[:, None], pos[None], -1)
    return Accepted(nodes=nodes[:, : int(length.max())], length=length, bonus=bonus)  # sync


def typical_accept(
    probs: Tensor,  # (N, V) target probabilities at every node (after warpers)
    tokens: Tensor,  # (N,)
    retrieve_indices: Tensor,  # (P, D+1) padded with -1
    threshold: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Medusa's typical acceptance. LOSSY: the output no longer follows the target's distribution.

    A draft x is kept when p(x) > min(threshold, alpha * exp(-H(p))) at its parent; the longest
    kept path wins (ties: first) and the bonus token is sampled from p at its last node.
    """
    entropy = -(probs * probs.clamp(min=1e-10).log()).sum(dim=-1)  # (N,)
    cutoff = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    valid = retrieve_indices >= 0
    idx = retrieve_indices.clamp(min=0)
    p_draft = probs[idx[:, :-1], tokens[idx[:, 1:]]]  # (P, D): p at the parent of each draft
    keep = (p_draft > cutoff[idx[:, :-1]]) & valid[:, 1:]
    run = keep.long().cumprod(dim=1).sum(dim=1)
    best = run.argmax()
    length = run[best] + 1
    pos = torch.arange(retrieve_indices.shape[1], device=tokens.device)
    nodes = torch.where(pos < length, retrieve_indices[best], -1)
    last = nodes[length - 1]
    bonus = _sample_rows(probs[last][None], generator)
    return Accepted(nodes=nodes[None], length=length[None], bonus=bonus)
