"""Medusa-1: K heads on the target's final hidden state, head k trained on the token k+2 ahead."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from infer.target import TargetOutput
from train.config import TrainConfig
from train.features import Features
from train.losses import LossOutput, medusa_loss
from train.objectives.base import Objective, target_logits


class MedusaObjective(Objective):
    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        top1 = target_logits(target, states.final_hidden).argmax(-1) if need_top1 else None
        return Features(batch["input_ids"], batch["loss_mask"], states.final_hidden.float(), top1=top1)

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        return medusa_loss(self.head(features.hidden), features.input_ids, features.loss_mask, self.decay)

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        return head(features.hidden)[:depth].argmax(-1)

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        depth = cfg.train.eval_depth or head.config.num_heads
        if depth > head.config.num_heads:
            raise ValueError(f"train.eval_depth={depth} exceeds the Medusa head's num_heads={head.config.num_heads}")
        return depth


OBJECTIVE = MedusaObjective
