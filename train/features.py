"""What a head trains on from one batch: ``Features``, computed by one frozen target forward.

This record holds what the training loop and evaluation read of every kind; each objective
(``train/objectives/<kind>.py``) extends it with what its own head and loss read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Features:
    """What every head needs from one batch, computed by one target forward (no grad)."""

    input_ids: Tensor  # (B, T)
    loss_mask: Tensor  # (B, T) 1 = token is a training target
    # (B, T, H_t) final post-norm or (B, T, n·H_t) aux states the head reads, fp32; None in Medusa-2
    # training (the adapted target runs inside the objective, with grad)
    hidden: Tensor | None
    top1: Tensor | None = None  # (B, T) target argmax, when logits were computed (evaluation reads it)
    rollout: Any = None  # train.on_policy.Rollout: the on-policy stage's drafted chains and the target's verdict
