"""MTP: the target's own MTP block fine-tuned with multi-step cross-entropy and step decay (FastMTP, speculators:
step k weighs ``train.loss_decay``**k, 0.6 unless set), unrolled as EAGLE's training-time test: step k at
position i reads the block's own step k-1 output and token i+1+k, and matches the target's law of token
i+2+k (a block of n layers: step k runs layer k mod n, ``train.mtp_unroll``). The target, its embedding and
its lm_head stay frozen (the head holds none of them)."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from draftsmith.target.model import TargetOutput
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, decayed_sum, restrict_to_draft_vocab, ttt_step_loss
from draftsmith.train.objectives.base import Objective, no_grad_embeds, target_logits
from draftsmith.train.objectives.eagle3 import Eagle3Features
from draftsmith.train.settings import OptimConfig, TrainConfig
from draftsmith.train.mtp_unroll import mtp_unroll

MTP_STEP_DECAY = 0.6  # FastMTP's and speculators' step decay beta
MTP_STEPS = 3  # draft steps unrolled per position (FastMTP trains 3)


class MtpObjective(Objective):
    reads = ("head.ttt_steps",)

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        if cfg.head.ttt_steps is None:
            cfg.head.ttt_steps = MTP_STEPS
        default = {f.name: f.default for f in dataclasses.fields(OptimConfig)}["loss_decay"]
        if cfg.train.loss_decay == default:
            cfg.train.loss_decay = MTP_STEP_DECAY

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.ttt_steps = cfg.head.ttt_steps or MTP_STEPS
        self.loss = cfg.train.loss if cfg.train.loss in ("ce", "lk", "lk-lambda") else "ce"

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        ids = batch["input_ids"]
        targets = restrict_to_draft_vocab(target_logits(target, states.final_hidden), None)
        return Eagle3Features(input_ids=ids, loss_mask=batch["loss_mask"], hidden=states.final_hidden.float(),
                              embeds=no_grad_embeds(target, ids), targets=targets, top1=targets.top1)

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features
        steps = [ttt_step_loss(lm_head(out), f.targets, f.loss_mask, k, self.loss)
                 for k, out in enumerate(mtp_unroll(self.head, f.hidden, f.embeds, self.ttt_steps))]
        return LossOutput(decayed_sum([s.loss for s in steps], self.decay),
                          *(torch.cat([getattr(s, n) for s in steps]) for n in ("step_losses", "correct", "count",
                                                                                 "accept")))

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> torch.Tensor:
        return torch.stack([lm_head(out).argmax(-1) for out in mtp_unroll(head, features.hidden, features.embeds, depth)])

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        return cfg.train.eval_depth or cfg.head.ttt_steps or MTP_STEPS


OBJECTIVE = MtpObjective
