"""The on-policy stage (``train.stage=on-policy``; Draft-OPD, docs/objectives.md): a trained head drafts
chains from roots of the training rows, the frozen target verifies them, and the head trains on its own
drafted contexts against the target's law there.

A chain rooted at token r (the last accepted token) drafts tokens r+1 .. r+K. Its position k is scored
against the target's law of token r+1+k given ``input_ids[:r+1]`` followed by the chain's own drafts
``d_0 .. d_{k-1}``: never the data's tokens after r (they are what the target wrote, not what the head
drafted). With greedy verification the chain's accepted length n is the number of leading drafts equal
to the target's argmax; positions k < n take forward KL, positions k >= n reverse KL weighted
``decay ** (k - n)`` (``train.losses.on_policy_loss``). A head whose inputs never read its drafts (DFlash: the
root and mask tokens) trains its positions k >= n against the target's law after the *accepted* prefix (the
supervised law) instead: the law after its wrong drafts is one it can never condition on, and training it
there lowered simulated tau (docs/objectives.md).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.target.model import causal_lm_of, target_forward
from draftsmith.train.losses import LossOutput, on_policy_loss
from draftsmith.train.metrics import acceptance_rate


@dataclass
class Rollout:
    """One batch's drafted chains and the target's verdict on them (no grad)."""

    roots: Tensor  # (B, N) the root token's position r of each chain
    keep: Tensor  # (B, N) bool: a real chain (rows have different numbers of roots)
    drafts: Tensor  # (B, N, K) target-vocab ids the head drafted for tokens r+1 .. r+K
    target_logp: Tensor  # (B, N, K, V') the target's log-law at each chain position, given the drafted prefix
    target_top1: Tensor  # (B, N, K) the target's argmax there (full vocabulary): what greedy verification accepts
    step_embeds: Tensor | None = None  # eagle3: (K-1, B, T, H_t) embeddings of the drafts read by steps 1..K-1
    after_rejection: Tensor | None = None  # (B, N, K, V') heads that never read their drafts: the law after the accepted prefix
    after_valid: Tensor | None = None  # (B, N, K) bool: where after_rejection is defined (inside the row)

    def since_rejection(self) -> Tensor:
        """(B, N, K) long: k - n, with n each chain's accepted length (negative where k was accepted)."""
        matched = (self.drafts == self.target_top1).long().cumprod(-1)
        accepted = matched.sum(-1, keepdim=True)  # (B, N, 1)
        return torch.arange(self.drafts.shape[-1], device=self.drafts.device) - accepted


@torch.no_grad()
def verify_drafts(target: nn.Module, input_ids: Tensor, roots: Tensor, drafts: Tensor) -> Tensor:
    """(B, N, K, V) the target's logits at chain position k of each root: the law of token r+1+k given
    ``input_ids[:r+1]`` then ``drafts[..., :k]``. input_ids (B, T); roots (B, N); drafts (B, N, K).

    Each chain is one row of ``input_ids[:r+1] + drafts[:K-1]`` (B·N rows, right-padded: causal attention
    keeps whatever follows position r+K-1 out of the logits that are read)."""
    batch, n, depth = drafts.shape
    length = int(roots.max()) + depth  # note: a host-device sync, once per batch
    base = input_ids[:, :length]
    if base.shape[1] < length:
        base = torch.cat([base, base.new_zeros(batch, length - base.shape[1])], dim=1)
    rows = base[:, None].expand(batch, n, length).clone()  # (B, N, L)
    if depth > 1:
        rows.scatter_(2, roots[..., None] + 1 + torch.arange(depth - 1, device=roots.device), drafts[..., :-1])
    hidden = target_forward(target, rows.view(batch * n, length), compute_logits=False).final_hidden
    positions = roots[..., None] + torch.arange(depth, device=roots.device)  # (B, N, K)
    hidden = hidden.view(batch, n, length, -1)
    read = hidden.gather(2, positions[..., None].expand(-1, -1, -1, hidden.shape[-1]))  # (B, N, K, H_t)
    lm_head = causal_lm_of(target).get_output_embeddings()
    return lm_head(read.to(lm_head.weight.dtype)).float()


def on_policy_output(logits_at: Callable[[int], Tensor], rollout: Rollout, decay: float,
                     to_target: Callable[[Tensor], Tensor] = lambda ids: ids) -> LossOutput:
    """The stage's loss and per-position statistics. ``logits_at(k)``: the head's logits (B, N, V') at chain
    position k, with grad; ``to_target`` maps their argmax into target ids (a reduced draft vocabulary)."""
    since = rollout.since_rejection()
    total = torch.zeros((), device=rollout.drafts.device)
    losses, correct, count, accept = [], [], [], []
    for k in range(rollout.drafts.shape[-1]):
        logits = logits_at(k)
        after = None if rollout.after_rejection is None else rollout.after_rejection[:, :, k]
        valid = rollout.keep if after is None else rollout.keep & ((since[..., k] < 0) | rollout.after_valid[..., k])
        value, fkl, rkl = on_policy_loss(logits, rollout.target_logp[:, :, k], since[..., k], valid, decay, after)
        total = total + value
        n = rollout.keep.sum().float()
        losses.append(((fkl + rkl).sum() / n.clamp(min=1)).detach())
        correct.append(((to_target(logits.argmax(-1)) == rollout.target_top1[:, :, k]) & rollout.keep).sum().float())
        count.append(n)
        accept.append((acceptance_rate(logits.detach(), rollout.target_logp[:, :, k].exp()) * rollout.keep).sum())
    chains = rollout.keep.sum().clamp(min=1)
    return LossOutput(total / chains, torch.stack(losses), torch.stack(correct), torch.stack(count),
                      torch.stack(accept))
