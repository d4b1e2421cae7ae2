"""Medusa: K heads on the target's final hidden state, head k trained on the token k+2 ahead.

Medusa-1 keeps the target frozen. Medusa-2 (``train.backbone_lora_rank`` >= 1; arXiv 2401.10774, its
self-distillation recipe) trains LoRA adapters on the target with the heads: loss =
KL(original || adapted) over the loss-masked next-token distributions + heads_coefficient ·
Σ_k loss_decay^k · CE_k of the heads on the adapted target's hidden states. The original's
distribution is the same target with its adapters off (``train.backbone.original``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.target.model import TargetOutput, target_forward
from draftsmith.train.backbone import add_lora, has_lora, lora_parameters, original
from draftsmith.train.settings import ConfigError, TrainConfig
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, medusa_loss, medusa_soft_loss, soft_loss
from draftsmith.train.objectives.base import Objective, target_logits


@dataclass(kw_only=True)
class MedusaFeatures(Features):
    logits: Tensor | None = None  # (B, T, V) Medusa-2: the original target's logits (its self-distillation)


class MedusaObjective(Objective):
    reads = ("train.backbone_lora_rank",)

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        """Evaluation drafts no deeper than the heads; Medusa-2 (a trained backbone) with neither stored
        hidden states nor another loss."""
        head, data, opt = cfg.head, cfg.data, cfg.train
        if head.num_heads is not None and opt.eval_depth is not None and opt.eval_depth > head.num_heads:
            raise ConfigError(f"train.eval_depth={opt.eval_depth} exceeds head.num_heads={head.num_heads}")
        if not opt.backbone_lora_rank:
            return
        stored = "data.features" if data.features is not None else "data.feature_cache" if data.feature_cache else None
        if stored:
            raise ConfigError(f"{stored} with train.backbone_lora_rank={opt.backbone_lora_rank}: Medusa-2 trains "
                              "the target, so its hidden states change every step and stored ones are stale; set one "
                              "to null")
        if opt.loss != "ce":
            raise ConfigError(f"train.loss={opt.loss} with train.backbone_lora_rank={opt.backbone_lora_rank}: "
                              "Medusa-2 keeps its own combined loss (self-distillation + the heads' CE); set one of "
                              "them back")

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.lora_rank = cfg.train.backbone_lora_rank
        self.backbone_lr = cfg.train.backbone_lr or cfg.train.lr / 4
        self.heads_coefficient = cfg.train.heads_coefficient
        self.loss = cfg.train.loss

    def attach_backbone(self, target: nn.Module) -> None:
        if self.lora_rank:
            self.backbone = add_lora(target, self.lora_rank)  # a submodule: DDP and clipping see the adapters

    def param_groups(self) -> list[dict]:
        groups = super().param_groups()
        if self.backbone is not None:
            groups.append({"params": list(lora_parameters(self.backbone).values()), "lr": self.backbone_lr})
        return groups

    def train(self, mode: bool = True):
        super().train(mode)
        if self.backbone is not None:
            self.backbone.eval()  # no dropout: the adapted and the original model see the same computation
        return self

    @classmethod
    @torch.no_grad()
    def features(cls, target: nn.Module, batch: dict, head: nn.Module, need_top1: bool = False,
                 states: TargetOutput | None = None) -> Features:
        if has_lora(target) and not need_top1:  # Medusa-2 training: the adapted target runs in forward, with grad
            with original(target):
                teacher = target_forward(target, batch["input_ids"]).logits.float()  # (B, T, V)
            return MedusaFeatures(input_ids=batch["input_ids"], loss_mask=batch["loss_mask"], hidden=None,
                                  logits=teacher)
        return super().features(target, batch, head, need_top1, states)

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        top1 = target_logits(target, states.final_hidden).argmax(-1) if need_top1 else None
        return MedusaFeatures(input_ids=batch["input_ids"], loss_mask=batch["loss_mask"],
                              hidden=states.final_hidden.float(), top1=top1)

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        if self.backbone is None and self.loss != "ce":  # the LK losses: against the target's own law
            with torch.no_grad():
                teacher = lm_head(features.hidden.to(lm_head.weight.dtype))
            return medusa_soft_loss(self.head(features.hidden), teacher, features.loss_mask, self.decay, self.loss)
        if self.backbone is None:
            return medusa_loss(self.head(features.hidden), features.input_ids, features.loss_mask, self.decay)
        out = target_forward(self.backbone.get_base_model(), features.input_ids)  # adapters on, with grad
        heads = medusa_loss(self.head(out.final_hidden.float()), features.input_ids, features.loss_mask, self.decay)
        # position t's distribution predicts token t+1: kept where t+1 carries loss. Soft CE = KL + the
        # original's entropy, a constant: the same gradient as the KL.
        distill, _ = soft_loss(out.logits[:, :-1], features.logits[:, :-1].softmax(-1), features.loss_mask[:, 1:])
        return heads._replace(loss=distill + self.heads_coefficient * heads.loss)

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
