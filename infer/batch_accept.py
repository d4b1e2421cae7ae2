"""One step's acceptance for a batch of rows: each row's draft through the acceptance rules of ``infer.accept``,
gathered into (nodes, new tokens, lengths) the generator compacts and emits."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.infer.accept import (Accepted, categorical, chain_sample_accept, greedy_accept_rows, tree_sample_accept,
                                     typical_accept)
from draftsmith.infer.drafters import Draft, Sampling
from draftsmith.infer.traversal import traversal_accept

# the rules at temperature > 0: token by token, sequence by sequence (both lossless), Medusa's typical (lossy)
ACCEPTANCE_RULES = ("exact", "traversal", "typical")


def sample_accept(logits: Tensor, draft: Draft, sampling: Sampling, acceptance: str,
                  typical: tuple[float, float]) -> Accepted:
    """One row's acceptance at temperature > 0 (greedy rows are accepted together: ``accept_rows``):
    ``acceptance`` "typical" (lossy, with ``typical`` = (threshold, alpha)), "traversal" or "exact"."""
    tree = draft.tree
    p = sampling.probs(logits)  # (N, V)
    if acceptance == "typical":
        return typical_accept(p, draft.tokens, tree.retrieve_indices, *typical)
    if acceptance == "traversal":
        return traversal_accept(p[None], draft.tokens[None], tree, None if draft.q is None else draft.q[None])
    if draft.q is not None and tree.children.shape[1] == 1:  # a sampled chain
        return chain_sample_accept(p[None], draft.q[None], draft.tokens[None])
    if draft.q is not None:  # a sampled tree: each node's law for its children (siblings share their parent's)
        laws = draft.q.new_zeros(tree.num_nodes, draft.q.shape[-1]).index_copy(0, tree.parents[1:], draft.q)
        return tree_sample_accept(p[None], draft.tokens[None], tree.children, q=laws[None])
    return tree_sample_accept(p[None], draft.tokens[None], tree.children)


def accept_rows(logits: Tensor, drafts: list[Draft], live: list[int], sampling: Sampling, acceptance: str = "exact",
                typical: tuple[float, float] = (0.09, 0.3)) -> tuple[Tensor, Tensor, Tensor]:
    """Accept every live row's draft from the verify's ``logits`` (B, W, V): (nodes (B, W) accepted node indices
    root first, -1 after; new (B, W) the accepted drafts then the bonus; length (B,) accepted nodes per row).
    Greedy: every row at once on the device; sampling: each row's draft accepted on its own (the accept loop
    reads the host per level)."""
    bsz, width = logits.shape[:2]
    device = drafts[0].tokens.device  # the generator's (a sharded target's logits may sit elsewhere)
    if sampling.greedy and width == 1:  # every row verified its root alone (plain decoding): the argmax is all
        bonus = logits[:, 0].float().argmax(dim=-1)[:, None].to(device)  # (B, 1), as greedy_accept_rows picks it
        return torch.zeros_like(bonus), bonus, torch.ones(bsz, dtype=torch.long, device=device)
    if sampling.greedy:
        tokens = torch.stack([nn.functional.pad(d.tokens, (0, width - d.tokens.shape[0])) for d in drafts])  # (B, N)
        depth = max(d.tree.retrieve_indices.shape[1] for d in drafts)
        paths = torch.full((bsz, max(d.tree.retrieve_indices.shape[0] for d in drafts), depth), -1,
                           dtype=torch.long, device=device)
        for b, d in enumerate(drafts):
            paths[b, : d.tree.retrieve_indices.shape[0], : d.tree.retrieve_indices.shape[1]] = d.tree.retrieve_indices
        accepted = greedy_accept_rows(logits, tokens, paths)
        drafted = tokens.gather(1, accepted.nodes[:, 1:].clamp(min=0))  # (B, D) the accepted drafts
        nodes, length, bonus = accepted.nodes, accepted.length, accepted.bonus
    else:
        nodes = torch.full((bsz, width), -1, dtype=torch.long, device=device)
        drafted = torch.zeros((bsz, width - 1), dtype=torch.long, device=device)
        length = torch.ones(bsz, dtype=torch.long, device=device)  # a finished row: its root alone
        bonus = torch.zeros(bsz, dtype=torch.long, device=device)
        for b in live:
            draft = drafts[b]
            if draft.tokens.shape[0] == 1 and acceptance == "exact":  # the root alone: its bonus is a draw from p,
                bonus[b] = categorical(sampling.probs(logits[b, 0]))  # as tree_sample_accept draws it
                nodes[b, 0] = 0
                continue
            accepted = sample_accept(logits[b, : draft.tokens.shape[0]], draft, sampling, acceptance, typical)
            path = accepted.nodes[0]  # (W,) root first, -1 after the accepted nodes
            nodes[b, : path.shape[0]] = path
            drafted[b, : path.shape[0] - 1] = draft.tokens[path[1:].clamp(min=0)]
            length[b], bonus[b] = accepted.length[0], accepted.bonus[0]
    new = torch.cat([drafted, drafted.new_zeros(bsz, 1)], dim=1)
    new.scatter_(1, (length - 1)[:, None], bonus[:, None])  # (B, D+1) the accepted drafts then the bonus
    return nodes, new, length


__all__ = ["ACCEPTANCE_RULES", "accept_rows", "sample_accept"]
