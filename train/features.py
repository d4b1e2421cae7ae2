"""What a head trains on from one batch: ``Features``, computed by one frozen target forward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from train.losses import DraftTargets


@dataclass
class Features:
    """What the head needs from one batch, computed by one target forward (no grad)."""

    input_ids: Tensor  # (B, T)
    loss_mask: Tensor  # (B, T) 1 = token is a training target
    # (B, T, H_t) final post-norm (medusa, eagle) or (B, T, n·H_t) aux (eagle3, dflash), fp32; None in
    # Medusa-2 training (the adapted target runs inside the objective, with grad)
    hidden: Tensor | None
    embeds: Tensor | None = None  # (B, T, H_t) target input embeddings (eagle, eagle3), fp32
    logits: Tensor | None = None  # (B, T, V) full target logits: eagle (its soft labels), medusa-2 (the original's)
    targets: DraftTargets | None = None  # eagle3: (B, T, Vd) soft labels + target top-1
    top1: Tensor | None = None  # (B, T) target argmax, when logits were computed
    noise: Tensor | None = None  # (B, T, H_t) EAGLE-1 augmentation, added to the head's input only
    anchors: Tensor | None = None  # (B, N) dflash: block start positions drawn for this step
    anchor_keep: Tensor | None = None  # (B, N) bool dflash: which drawn anchors are real (rows differ in length)
    mask_embed: Tensor | None = None  # (H_t,) dflash: the target's embedding of the head's mask token, fp32
    document_ids: Tensor | None = None  # (B, T) dflash: the document of each token in packed rows; None = one per row
    rollout: Any = None  # train.on_policy.Rollout: the on-policy stage's drafted chains and the target's verdict
