"""Draft-head losses as pure tensor functions (the published losses: docs/recipes.md).

One alignment rule for every head kind: draft step k at position i drafts token ``i + 2 + k``,
i.e. it imitates the target's distribution at position ``j = i + 1 + k`` (the target's logits at j
predict token j + 1). A (step, position) is trained iff that token exists and has ``loss_mask = 1``
(``loss_mask[t] == 1`` marks token t as a training target, see ``data.masks``).
Each function returns a ``LossOutput`` whose ``loss`` carries the gradient; the per-step tensors are
detached statistics for logging.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.train.metrics import acceptance_rate

EAGLE_CE_WEIGHT = 0.1  # EAGLE-1: SmoothL1 + 0.1 * soft CE (docs/recipes.md)
# LK^lambda's KL weight w = LK_KL_SCALE * exp(-LK_KL_DECAY * acceptance): the defaults of SpecForge's
# training script (--kl-scale 1.0, --kl-decay 3.0; docs/dflash.md)
LK_KL_SCALE, LK_KL_DECAY = 1.0, 3.0
DRAFT_LOSSES = ("ce", "lk", "lk-lambda", "dpace")


class LossOutput(NamedTuple):
    loss: Tensor  # scalar, the weighted total
    step_losses: Tensor  # (K,) detached, per draft step
    correct: Tensor  # (K,) detached, positions whose draft top-1 equals the target's
    count: Tensor  # (K,) detached, trained positions per step
    accept: Tensor | None = None  # (K,) detached, sum over trained positions of sum_v min(p_v, q_v) (metrics.py)


class DraftTargets(NamedTuple):
    """The target's next-token distribution, restricted to the draft vocabulary."""

    probs: Tensor  # (B, T, Vd) float32 softmax over the draft vocab
    top1: Tensor  # (B, T) int64 target-vocab argmax of the full logits
    in_vocab: Tensor  # (B, T) bool: the target's top-1 is in the draft vocab
    # (B, T) float32: the share of the target's law (T = 1) inside the draft vocab (1 with the full vocab), the most a
    # draft sampled from any law over the draft vocab survives speculative sampling with at T = 1
    mass: Tensor | None = None


def step_slices(seq_len: int, step: int) -> tuple[slice, slice, slice]:
    """(draft positions i, target positions j = i+1+k, label tokens i+2+k) for draft step ``step``."""
    n = max(seq_len - 2 - step, 0)
    return slice(0, n), slice(1 + step, 1 + step + n), slice(2 + step, 2 + step + n)


def restrict_to_draft_vocab(target_logits: Tensor, t2d: Tensor | None) -> DraftTargets:
    """Soft labels for EAGLE-3 from the target's full logits (B, T, V).

    ``t2d`` (V,) bool marks the draft vocabulary (``None`` = full vocabulary). Call it once per
    batch and drop the full logits afterwards: only (B, T, Vd) is kept for all TTT steps.
    """
    top1 = target_logits.argmax(dim=-1)  # (B, T)
    if t2d is None:
        return DraftTargets(target_logits.float().softmax(-1), top1, torch.ones_like(top1, dtype=torch.bool),
                            torch.ones_like(top1, dtype=torch.float32))
    inside = target_logits[..., t2d].float()  # (B, T, Vd), ids sorted as the draft vocab
    mass = (inside.logsumexp(-1) - float_logsumexp(target_logits)).exp()
    return DraftTargets(inside.softmax(-1), top1, t2d[top1], mass)


def float_logsumexp(logits: Tensor, rows: int = 256) -> Tensor:
    """(...) logsumexp over the last dim of ``logits`` (..., V) in float32, ``rows`` positions at a time: bf16
    logits keep no full float32 copy, and a bf16 result (its step 1/16 at 8) would be off by percents."""
    flat = logits.reshape(-1, logits.shape[-1])
    return torch.cat([chunk.float().logsumexp(-1) for chunk in flat.split(rows)]).view(logits.shape[:-1])


def top1_labels(probs: Tensor) -> Tensor:
    """The one-hot law (..., V) on each row's most probable entry of ``probs`` (..., V): soft CE against it is
    hard CE on the target's top-1 (``train.labels=top1``). Over a reduced draft vocabulary it is the top-1 there,
    the target's own wherever that lies inside (the positions trained by default)."""
    return F.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)


def mixed_labels(probs: Tensor, top1_share: float) -> Tensor:
    """(1 - ``top1_share``) x ``probs`` + ``top1_share`` x its one-hot top-1 (``train.top1_share``): soft CE against
    it is ``top1_share`` x hard CE on the top-1 + the rest x soft CE, one label for greedy and sampled verification."""
    return (1 - top1_share) * probs + top1_share * top1_labels(probs)


@torch.no_grad()
def law_inverse_temperature(logits: Tensor, probs: Tensor, mask: Tensor, iters: int = 6) -> Tensor:
    """The beta > 0 whose ``softmax(beta * logits)`` is closest to ``probs`` in soft CE over the rows ``mask`` keeps
    (a scalar tensor; 1 when no row is kept). The CE is convex in beta (derivative E_q[z] - E_p[z], second
    derivative Var_q[z]): Newton from 1, each step clamped to [1/4, 4] x beta and beta to [1/64, 64]."""
    z = logits.float()[mask]  # (n, V)
    if z.numel() == 0:
        return torch.ones((), device=logits.device)
    expected_p = (probs.float()[mask] * z).sum(-1).mean()
    beta = torch.ones((), device=z.device)
    for _ in range(iters):
        q = (beta * z).softmax(-1)
        mean = (q * z).sum(-1)
        var = ((q * z * z).sum(-1) - mean * mean).clamp(min=0).mean()
        step = (mean.mean() - expected_p) / var.clamp(min=1e-12)
        beta = (beta - step).clamp(beta / 4, beta * 4).clamp(1 / 64, 64)
    return beta


def soft_ce(logits: Tensor, probs: Tensor) -> Tensor:
    """Cross-entropy of ``logits`` (..., V) against a distribution ``probs`` (..., V) -> (...)."""
    shape = logits.shape[:-1]
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), probs.float().reshape(-1, probs.shape[-1]),
                         reduction="none")  # fused log-softmax: no (..., V) product kept for backward
    return ce.view(shape)


def _masked_mean(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(mean of ``values`` over ``mask``, count); 0 when nothing is masked in."""
    mask = mask.to(values.dtype)
    count = mask.sum()
    return (values * mask).sum() / count.clamp(min=1), count


def soft_loss(logits: Tensor, probs: Tensor, mask: Tensor, loss: str = "ce") -> tuple[Tensor, Tensor]:
    """(loss, count) of draft ``logits`` (..., V) against target ``probs`` (..., V) over ``mask`` (...).

    ``"ce"``: the masked mean soft cross-entropy. ``"lk"``: LK^alpha (arXiv 2602.23881; SpecForge's
    ``--lk-loss-type alpha``): ``-log`` of the masked mean expected acceptance rate
    ``sum_v min(p_v, q_v)``, the chance that a draft sampled from q survives min(1, p/q).
    ``"lk-lambda"``: LK^lambda, the hybrid with the KL term (SpecForge's ``--lk-loss-type lambda``):
    ``w * CE + (1 - w) * (1 - rate)`` with ``w = LK_KL_SCALE * exp(-LK_KL_DECAY * rate)`` (rate
    detached): the CE term leads while acceptance is low, the acceptance term once it is high.
    """
    if loss in ("ce", "dpace"):  # dpace: CE per element; its weights span positions (``dpace_weights``)
        return _masked_mean(soft_ce(logits, probs), mask)
    if loss not in DRAFT_LOSSES:
        raise ValueError(f"unknown draft loss {loss!r}; expected one of {', '.join(DRAFT_LOSSES)}")
    accept = acceptance_rate(logits, probs)  # (...)
    rate, count = _masked_mean(accept, mask)
    if loss == "lk":
        return -torch.log(rate.clamp(min=1e-6)) * (count > 0), count
    ce, _ = _masked_mean(soft_ce(logits, probs), mask)
    weight = LK_KL_SCALE * torch.exp(-LK_KL_DECAY * rate.detach())
    return (weight * ce + (1 - weight) * (1 - rate)) * (count > 0), count


def dpace_weights(confidence: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE's detached per-position weights (arXiv 2605.18810, as ModelOpt's ``_dpace_position_weights`` and
    speculators' ``dpace_loss_decay`` compute them) over the last dim, the K positions of one draft chain:

        q~_i = alpha + (1 - alpha) * q_i    (1 where ``valid`` is 0: a no-op in the product)
        C_m  = valid_m * prod_{i<=m} q~_i   (the chance the chain survives to m)
        w_j  = valid_j * sum_{m>=j} C_m     (C_j times the accepted length still to come)

    confidence (..., K): q_i, the draft's probability of the target's token; valid (..., K) bool; alpha:
    ``train.dpace_alpha`` (docs/objectives.md)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"D-PACE alpha must lie in (0, 1], got {alpha}")
    with torch.no_grad():
        keep = valid.bool()
        smoothed = torch.where(keep, alpha + (1 - alpha) * confidence.float(), torch.ones_like(confidence.float()))
        survive = torch.cumprod(smoothed, dim=-1) * keep
        suffix = survive.flip(-1).cumsum(-1).flip(-1)  # sum over m >= j
        return suffix * keep


def weighted_mean(elements: Tensor, weights: Tensor) -> Tensor:
    """sum(w * l) / sum(w) (0 when every weight is 0): D-PACE's reduction, as ModelOpt's DFlash loss divides
    by the weights' sum so the loss stays in CE units."""
    return (elements * weights).sum() / weights.sum().clamp(min=1e-6)


def on_policy_loss(logits: Tensor, target_logp: Tensor, since_rejection: Tensor, valid: Tensor,
                   decay: float, after_rejection: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Draft-OPD's loss at one chain position k (docs/objectives.md): (weighted sum over ``valid``, forward-KL
    elements of accepted positions, reverse-KL elements of rejected ones; both detached).

    logits (..., V): the draft's logits; target_logp (..., V): the target's log-law at that position given the
    *drafted* prefix (the verifier's, ``verify_drafts``); since_rejection (...) long: ``k - n`` with n the
    chain's accepted length (< 0: k was accepted; j >= 0: k is the j-th position after the first rejection).
    Accepted positions take forward KL(p || q) (as soft CE: the same gradient), rejected ones reverse
    KL(q || p) weighted ``decay ** j``; or, given ``after_rejection`` (..., V) (the target's log-law after the
    *accepted* prefix: a head whose inputs never read its drafts, DFlash), soft CE against that law there,
    weighted the same (the third value then holds those elements).
    """
    logq = F.log_softmax(logits.float(), dim=-1)
    fkl = -(target_logp.exp() * logq).sum(-1)  # KL(p||q) + H(p)
    rkl = (logq.exp() * (logq - target_logp.float())).sum(-1)  # KL(q||p)
    rejected = since_rejection >= 0
    if after_rejection is not None:  # the law the head is evaluated on there, not the one after its wrong drafts
        rkl = -(after_rejection.float().exp() * logq).sum(-1)
    weight = torch.where(rejected, decay ** since_rejection.clamp(min=0).float(), torch.ones_like(fkl))
    valid = valid.bool()
    total = torch.where(rejected, rkl, fkl) * weight * valid
    return total.sum(), (fkl * (~rejected & valid)).detach(), (rkl * (rejected & valid)).detach()


def decayed_sum(step_losses: list[Tensor], decay: float) -> Tensor:
    """Σ_k decay^k · loss_k."""
    return sum(decay**k * loss for k, loss in enumerate(step_losses))


def medusa_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor, decay: float) -> LossOutput:
    """Σ_k decay^k · CE_k with hard labels: head k at position t predicts token t+k+2.

    logits (K, B, T, V); input_ids, loss_mask (B, T). Accuracy is against the ground-truth token.
    """
    num_heads, _, seq_len, _ = logits.shape
    losses, correct, count = [], [], []
    for k in range(num_heads):
        pos, _, label = step_slices(seq_len, k)
        step_logits = logits[k][:, pos]  # (B, n, V)
        labels = input_ids[:, label]  # (B, n)
        mask = loss_mask[:, label].bool()
        ce = F.cross_entropy(step_logits.float().transpose(1, 2), labels, reduction="none")  # (B, n)
        loss, n = _masked_mean(ce, mask)
        losses.append(loss)
        correct.append(((step_logits.argmax(-1) == labels) & mask).sum())
        count.append(n)
    return LossOutput(decayed_sum(losses, decay), torch.stack(losses).detach(),
                      torch.stack(correct).float(), torch.stack(count).float())


def medusa_soft_loss(logits: Tensor, target_logits: Tensor, loss_mask: Tensor, decay: float, loss: str) -> LossOutput:
    """Medusa heads against the target's own distribution (self-distillation) with ``soft_loss``'s
    ``loss`` (the LK losses need the target's law, not the data's token): head k at position i is
    scored against the target's distribution at j = i + 1 + k, which predicts the token i + k + 2 it
    drafts. logits (K, B, T, V); target_logits (B, T, V). Accuracy is against the target's top-1."""
    num_heads, _, seq_len, _ = logits.shape
    losses, correct, count = [], [], []
    for k in range(num_heads):
        pos, tgt, label = step_slices(seq_len, k)
        step_logits, probs = logits[k][:, pos], target_logits[:, tgt].float().softmax(-1)
        mask = loss_mask[:, label].bool()
        value, n = soft_loss(step_logits, probs, mask, loss)
        losses.append(value)
        correct.append(((step_logits.argmax(-1) == probs.argmax(-1)) & mask).sum())
        count.append(n)
    return LossOutput(decayed_sum(losses, decay), torch.stack(losses).detach(),
                      torch.stack(correct).float(), torch.stack(count).float())


def eagle_loss(
    pred_hidden: Tensor,
    pred_logits: Tensor,
    target_hidden: Tensor,
    target_logits: Tensor,
    loss_mask: Tensor,
    ce_weight: float = EAGLE_CE_WEIGHT,
    loss: str = "ce",
) -> LossOutput:
    """EAGLE-1: SmoothL1(f̂, f) + ce_weight · CE_soft(lm_head(f̂), softmax(lm_head(f))); ``loss`` other
    than ``"ce"`` replaces the soft CE by that ``soft_loss`` (LK^alpha, LK^lambda).

    pred_hidden (B, T, H) at position i is f̂_{i+1}; pred_logits (B, T, V) = target lm_head of it.
    target_hidden (B, T, H) = f and target_logits (B, T, V) = lm_head(f), both at positions j.
    SmoothL1 is averaged over the hidden dimension, both terms over the trained positions.
    """
    pos, tgt, label = step_slices(pred_hidden.shape[1], 0)
    mask = loss_mask[:, label].bool()  # (B, n)
    regression = F.smooth_l1_loss(pred_hidden[:, pos].float(), target_hidden[:, tgt].float(),
                                  reduction="none").mean(-1)  # (B, n)
    pred, target = pred_logits[:, pos], target_logits[:, tgt]
    l1, n = _masked_mean(regression, mask)
    soft, _ = soft_loss(pred, target.float().softmax(-1), mask, loss)
    total = l1 + ce_weight * soft
    correct = ((pred.argmax(-1) == target.argmax(-1)) & mask).sum()
    return LossOutput(total, total.detach()[None], correct.float()[None], n.float()[None])


def ttt_step_loss(draft_logits: Tensor, targets: DraftTargets, loss_mask: Tensor, step: int,
                  loss: str = "ce") -> LossOutput:
    """One EAGLE-3 training-time-test step: soft CE against the draft-vocab target distribution.

    draft_logits (B, T, Vd) of step ``step``; positions whose target top-1 falls outside the draft
    vocabulary are masked out. Accuracy compares draft-vocab argmaxes (equal to target top-1
    agreement on the trained positions, where the target top-1 is in the draft vocab).
    """
    logits, probs, mask = ttt_step_view(draft_logits, targets, loss_mask, step)
    value, n = soft_loss(logits, probs, mask, loss)
    correct = ((logits.argmax(-1) == probs.argmax(-1)) & mask).sum()
    accept = (acceptance_rate(logits.detach(), probs) * mask).sum()
    return LossOutput(value, value.detach()[None], correct.float()[None], n.float()[None], accept[None])


def law_step_loss(draft_logits: Tensor, law: DraftTargets, loss_mask: Tensor, step: int, loss: str = "ce") -> Tensor:
    """``train.law_weight``'s term of TTT step ``step``: ``loss`` of ``beta x draft_logits`` against the target's law,
    beta (``law_inverse_temperature``, no grad) the logits' own inverse temperature on this batch: the law's shape
    without pulling the top-1's margins in."""
    logits, probs, mask = ttt_step_view(draft_logits, law, loss_mask, step)
    value, _ = soft_loss(law_inverse_temperature(logits, probs, mask) * logits, probs, mask, loss)
    return value


def ttt_step_view(draft_logits: Tensor, targets: DraftTargets, loss_mask: Tensor,
                  step: int) -> tuple[Tensor, Tensor, Tensor]:
    """(logits (B, n, Vd), target probs (B, n, Vd), trained mask (B, n)) of TTT step ``step``."""
    pos, tgt, label = step_slices(draft_logits.shape[1], step)
    return draft_logits[:, pos], targets.probs[:, tgt], loss_mask[:, label].bool() & targets.in_vocab[:, tgt]
