"""DSpark's loss (``head.variant=dspark``; DeepSpec's ``deepspec/modeling/dspark/loss.py``), read by the DFlash
objective on DFlash's blocks and anchors.

Slot k (0..B-1) of the block at anchor a drafts token a+k+1: its logits are the lm_head logits of the slot's
output plus the Markov bias of the data's token a+k (teacher forcing; slot 0's is the anchor's own token),
its target is the target's next-token law p at a+k, and it is trained while tokens a..a+k+1 are one run of
training targets (``block_labels``). With q = softmax(corrected logits) and slot weights
w_k = exp(-k/gamma) (0 off the trained slots), each term is a weighted mean over every trained slot:

    CE   = sum w * CE(q; p) / sum w        (DeepSpec: hard CE on the data's token; draftsmith: the target's law)
    L1   = sum w * ||q - p||_1 / sum w
    CONF = sum w * BCE(confidence, sum_v min(p_v, q_v)) / sum w    (the target detached)
    loss = CE_ALPHA * CE + L1_ALPHA * L1 + CONFIDENCE_ALPHA * CONF

with DeepSpec's Qwen3-4B weights (0.1, 0.9, 1.0; docs/dflash.md, "DSpark", for speculators' KL variant).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.variants.dspark import corrected
from draftsmith.infer.drafters.base import Sampling
from draftsmith.infer.drafters.variants.dspark import markov_walk
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, soft_ce
from draftsmith.train.metrics import acceptance_rate
from draftsmith.train.objectives.dflash import DFlashObjective, block_labels, gather_slots, slot_indices

# DeepSpec's config/dspark/dspark_qwen3_4b_online.py
CE_ALPHA, L1_ALPHA, CONFIDENCE_ALPHA = 0.1, 0.9, 1.0


def dspark_loss(head: nn.Module, lm_head: nn.Module, features, out: Tensor, trained: Tensor,
                decay: float) -> LossOutput:
    """DSpark's loss of the head's block outputs ``out`` (B, N, bs, H) at ``features.anchors``; ``trained``
    (B, N, bs) the slots with a training label; slot k weighted ``decay ** k``."""
    f, bs = features, out.shape[2]
    at = slot_indices(f.anchors, bs, f.input_ids.shape[1])
    slots = corrected(head.markov_head, head.confidence_head, out, lm_head(out).float(), gather_slots(f.input_ids, at))
    probs = gather_slots(f.targets.probs, at)  # (B, N, bs, V)
    weights = trained.float() * decay ** torch.arange(bs, device=out.device, dtype=torch.float32)
    total = weights.sum().clamp(min=1e-6)
    ce = soft_ce(slots.logits, probs)  # (B, N, bs)
    q = slots.logits.softmax(-1)
    l1 = (q - probs).abs().sum(-1)
    accept = acceptance_rate(slots.logits.detach(), probs)
    bce = F.binary_cross_entropy_with_logits(slots.confidence, accept, reduction="none")
    loss = (CE_ALPHA * (ce * weights).sum() + L1_ALPHA * (l1 * weights).sum()
            + CONFIDENCE_ALPHA * (bce * weights).sum()) / total
    mask = trained.float()
    count = mask.sum((0, 1))
    correct = ((slots.logits.argmax(-1) == gather_slots(f.top1, at)).float() * mask).sum((0, 1))
    step_losses = ((ce.detach() * mask).sum((0, 1)) / count.clamp(min=1))
    return LossOutput(loss, step_losses, correct, count, (accept * mask).sum((0, 1)))


@torch.no_grad()
def greedy_slots(head: nn.Module, lm_head: nn.Module, out: Tensor, roots: Tensor) -> Tensor:
    """(B, C, depth) DSpark's greedy drafts from block outputs ``out`` (B, C, depth, H) after ``roots`` (B, C)."""
    batch, chunk, depth, _ = out.shape
    tokens, _, _ = markov_walk(head, out.flatten(0, 1), lm_head(out).float().flatten(0, 1), roots.flatten(), Sampling())
    return tokens.view(batch, chunk, depth)


class DSparkObjective(DFlashObjective):
    """DFlash's objective on DSpark's slots: every slot drafts (slot k the token a+k+1), DeepSpec's loss."""

    untrained_on_policy = "DSpark's Markov and confidence heads"
    own_loss = "DeepSpec's CE + L1 + confidence loss"

    def block_loss(self, f: Features, out: Tensor, lm_head: nn.Module) -> LossOutput:
        trained = block_labels(f.loss_mask, f.anchors, f.anchor_keep, self.head.config.block_size + 1,
                               f.document_ids)[..., 1:]  # slot k's label is a+k+1
        return dspark_loss(self.head, lm_head, f, out, trained, self.decay)

    @staticmethod
    def greedy_block(head: nn.Module, features: Features, out: Tensor, roots: Tensor, lm_head: nn.Module) -> Tensor:
        return greedy_slots(head, lm_head, out, roots)


OBJECTIVE = DSparkObjective
