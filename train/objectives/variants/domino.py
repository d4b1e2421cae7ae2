"""Domino's loss (``head.variant=domino``; SpecForge's ``OnlineDominoModel.forward``), read by the DFlash objective
on DFlash's blocks and anchors.

Slot k (0..B-1) of the block at anchor a drafts token a+k+1 (SpecForge's ``shift_label``). The GRU reads the
target's embeddings of the data's tokens a..a+B-1 from a zero state per block (teacher forcing), s_k the state
after a..a+k; the corrected logits of slot k are ``lm_head(h_k) + embed_proj([h_k ; s_k])`` from
``pure_draft_prefix_len`` on, ``lm_head(h_k)`` before (``heads.variants.domino``). With slot weights w_k = exp(-k/gamma)
on the trained slots (0 elsewhere) and

    final = sum w * CE(corrected; p) / (sum w + 1e-6),   base = sum w * CE(lm_head(h); p) / (sum w + 1e-6)
    loss  = (1 - lambda) * final + lambda * base

where lambda follows SpecForge's ``linear_lambda_base`` over the run's steps (``train.lambda_base_start``,
``train.lambda_base_decay_ratio``). SpecForge's CE is on the data's token; draftsmith's is soft CE against the
target's law p at a+k, as every kind's (docs/dflash.md, "Domino").
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.heads.variants.domino import correction, prefix_states
from draftsmith.infer.drafters.base import Sampling
from draftsmith.infer.drafters.variants.domino import domino_walk
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, soft_ce
from draftsmith.train.metrics import acceptance_rate
from draftsmith.train.objectives.dflash import DFlashObjective, block_labels, gather_slots, slot_indices
from draftsmith.train.settings import TrainConfig

# SpecForge's linear_lambda_base defaults (its Qwen3-8B example sets the decay ratio to 1.0)
LAMBDA_BASE_START, LAMBDA_BASE_DECAY_RATIO = 1.0, 0.5


def linear_lambda_base(step: int, total_steps: int, start: float = LAMBDA_BASE_START,
                       decay_ratio: float = LAMBDA_BASE_DECAY_RATIO) -> float:
    """The base loss's weight at ``step`` of ``total_steps``: ``start`` falling linearly to 0 over the first
    ``max(1, int(total_steps * decay_ratio))`` steps, 0 after, clamped into [0, 1]."""
    decay_steps = max(1, int(total_steps * decay_ratio))
    return max(0.0, min(1.0, start * (1.0 - min(step / decay_steps, 1.0))))


def corrected_logits(head: nn.Module, out: Tensor, base: Tensor, states: Tensor) -> Tensor:
    """(..., bs, V) float32: ``base`` (..., bs, V) with the correction of slots ``out`` (..., bs, H) at GRU states
    ``states`` (..., bs, G) added from slot ``pure_draft_prefix_len`` on."""
    start = head.config.pure_draft_prefix_len
    suffix = base[..., start:, :] + correction(head.embed_proj, out[..., start:, :], states[..., start:, :])
    return torch.cat([base[..., :start, :], suffix], dim=-2)


def domino_loss(head: nn.Module, lm_head: nn.Module, features, out: Tensor, trained: Tensor, decay: float,
                lambda_base: float) -> LossOutput:
    """Domino's loss of the head's block outputs ``out`` (B, N, bs, H) at ``features.anchors``; ``trained``
    (B, N, bs) the slots with a training label; slot k weighted ``decay ** k``; ``lambda_base`` the base loss's
    weight this step."""
    f, bs = features, out.shape[2]
    at = slot_indices(f.anchors, bs, f.input_ids.shape[1])  # slot k reads tokens a..a+k and drafts a+k+1
    base = lm_head(out).float()
    final = corrected_logits(head, out, base, prefix_states(head.prefix_gru, gather_slots(f.embeds, at)))
    probs = gather_slots(f.targets.probs, at)  # (B, N, bs, V)
    weights = trained.float() * decay ** torch.arange(bs, device=out.device, dtype=torch.float32)
    total = weights.sum() + 1e-6
    final_ce = soft_ce(final, probs)
    loss = (1 - lambda_base) * (final_ce * weights).sum() / total
    if lambda_base > 0:
        loss = loss + lambda_base * (soft_ce(base, probs) * weights).sum() / total
    mask = trained.float()
    count = mask.sum((0, 1))
    correct = ((final.argmax(-1) == gather_slots(f.top1, at)).float() * mask).sum((0, 1))
    step_losses = (final_ce.detach() * mask).sum((0, 1)) / count.clamp(min=1)
    accept = acceptance_rate(final.detach(), probs)
    return LossOutput(loss, step_losses, correct, count, (accept * mask).sum((0, 1)))


@torch.no_grad()
def greedy_slots(head: nn.Module, lm_head: nn.Module, embed: nn.Module, out: Tensor, roots: Tensor) -> Tensor:
    """(B, C, depth) Domino's greedy drafts from block outputs ``out`` (B, C, depth, H) after ``roots`` (B, C),
    the GRU stepped on its own drafts as the drafter steps it."""
    batch, chunk, depth, _ = out.shape
    tokens, _ = domino_walk(head, embed, out.flatten(0, 1), lm_head(out).float().flatten(0, 1), roots.flatten(),
                            Sampling())
    return tokens.view(batch, chunk, depth)


class DominoObjective(DFlashObjective):
    """DFlash's objective on Domino's slots: every slot drafts (slot k the token a+k+1), corrected by the GRU, the
    λ-blend of the corrected and the plain logits' CE, λ following the run's progress (``follow_schedule``)."""

    untrained_on_policy = "Domino's GRU correction"
    own_loss = "the blend of its corrected and plain CE"

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        opt = cfg.train
        self.lambda_start = LAMBDA_BASE_START if opt.lambda_base_start is None else opt.lambda_base_start
        self.lambda_ratio = LAMBDA_BASE_DECAY_RATIO if opt.lambda_base_decay_ratio is None else opt.lambda_base_decay_ratio
        self.lambda_base = min(1.0, self.lambda_start)  # the base loss weight (step 0's until at_step)

    def follow_schedule(self, step: int, max_steps: int) -> None:
        """This step's base loss weight (SpecForge's ``linear_lambda_base``)."""
        self.lambda_base = linear_lambda_base(step, max_steps, self.lambda_start, self.lambda_ratio)

    def block_loss(self, f: Features, out: Tensor, lm_head: nn.Module) -> LossOutput:
        trained = block_labels(f.loss_mask, f.anchors, f.anchor_keep, self.head.config.block_size + 1,
                               f.document_ids)[..., 1:]  # slot k's label is a+k+1
        return domino_loss(self.head, lm_head, f, out, trained, self.decay, self.lambda_base)

    @staticmethod
    def greedy_block(head: nn.Module, features: Features, out: Tensor, roots: Tensor, lm_head: nn.Module) -> Tensor:
        return greedy_slots(head, lm_head, features.embedding, out, roots)


OBJECTIVE = DominoObjective
