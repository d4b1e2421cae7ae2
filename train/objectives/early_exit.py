"""Early exit (Kangaroo, arXiv 2404.18911): the adapter on the target's layer-k state learns the
target's final next-token distribution (soft cross-entropy through the target's frozen lm_head, or an LK
loss: ``train.loss``).

Kangaroo trains its adapter with the target frozen against the target's own output distribution;
one target forward per batch gives both the layer-k states (the adapter's input) and the final
logits (its labels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.infer.drafters.early_exit import DEFAULT_CHAIN
from draftsmith.target.model import TargetOutput
from draftsmith.train.settings import TrainConfig
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, soft_loss, step_slices
from draftsmith.train.objectives.base import Objective, target_logits
from draftsmith.train.unroll import shift_left


def positions(hidden: Tensor) -> Tensor:
    """The plain position ids (B, T) of a training sequence."""
    return torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[:2])


@dataclass(kw_only=True)
class EarlyExitFeatures(Features):
    logits: Tensor  # (B, T, V) the target's logits: the adapter's soft labels


class EarlyExitObjective(Objective):
    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.loss = cfg.train.loss

    @staticmethod
    def aux_layer_ids(head: nn.Module) -> tuple[int, ...]:
        return tuple(head.feature_layer_ids)  # (exit_layer,): the state the adapter reads

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        """The layer-k states (the adapter's input) and the target's logits from its final states (the labels)."""
        logits = target_logits(target, states.final_hidden)  # (B, T, V)
        return EarlyExitFeatures(input_ids=batch["input_ids"], loss_mask=batch["loss_mask"],
                                 hidden=states.aux_hidden.float(), logits=logits, top1=logits.argmax(-1))

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        """The adapter's logits at position j against the target's at j (token j+1 is the label);
        trained where ``loss_mask`` marks token j+1 (``train.losses.step_slices`` step 0: j = i+1)."""
        f = features
        out = self.head(hidden_states=f.hidden, position_ids=positions(f.hidden)).hidden_states
        _, j, label = step_slices(f.hidden.shape[1], 0)
        logits = lm_head(out[:, j])  # (B, n, V)
        target = f.logits[:, j]
        mask = f.loss_mask[:, label].bool()
        value, n = soft_loss(logits, target.float().softmax(-1), mask, self.loss)
        correct = ((logits.argmax(-1) == target.argmax(-1)) & mask).sum()
        return LossOutput(value, value.detach()[None], correct.float()[None], n.float()[None])

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        """Step k at position i is the adapter's argmax at position i+1+k, teacher-forced: what the
        drafter proposes there when its earlier drafts were the data's tokens (``train.metrics``)."""
        out = head(hidden_states=features.hidden, position_ids=positions(features.hidden)).hidden_states
        top1 = lm_head(out).argmax(-1)  # (B, T): the draft of token t+1 read at t
        return torch.stack([shift_left(top1, 1 + k) for k in range(depth)])

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        return cfg.train.eval_depth or DEFAULT_CHAIN.length  # the drafter's default chain


OBJECTIVE = EarlyExitObjective
