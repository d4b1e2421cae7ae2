"""EAGLE-1/2: the head regresses the target's next feature (SmoothL1) and matches its next-token
distribution through the target's frozen lm_head; uniform noise on the head's input feature."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.target.model import TargetOutput
from draftsmith.train.settings import DEFAULT_FEATURE_NOISE, TrainConfig
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, eagle_loss
from draftsmith.train.objectives.base import Objective, no_grad_embeds, target_logits
from draftsmith.train.unroll import shift_left, unroll


@dataclass(kw_only=True)
class EagleFeatures(Features):
    embeds: Tensor  # (B, T, H_t) the target's input embeddings, fp32
    logits: Tensor  # (B, T, V) the target's logits: the soft labels
    noise: Tensor | None = None  # (B, T, H_t) EAGLE-1 augmentation, added to the head's input only


class EagleObjective(Objective):
    reads = ("train.feature_noise",)

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        if cfg.train.feature_noise is None:
            cfg.train.feature_noise = DEFAULT_FEATURE_NOISE

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.loss = cfg.train.loss

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        ids = batch["input_ids"]
        logits = target_logits(target, states.final_hidden)
        return EagleFeatures(input_ids=ids, loss_mask=batch["loss_mask"], hidden=states.final_hidden.float(),
                             embeds=no_grad_embeds(target, ids), logits=logits, top1=logits.argmax(-1))

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features  # input f_i (+ noise) with token i+1; the regression target stays clean
        x = f.hidden if f.noise is None else f.hidden + f.noise
        positions = torch.arange(f.hidden.shape[1], device=f.hidden.device).expand(f.hidden.shape[:2])
        out = self.head(hidden_states=x, inputs_embeds=shift_left(f.embeds, 1), position_ids=positions).hidden_states
        return eagle_loss(out, lm_head(out), f.hidden, f.logits, f.loss_mask, loss=self.loss)

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        return torch.stack([lm_head(out).argmax(-1) for out in unroll(head, features.hidden, features.embeds, depth)])

    def perturb(self, features: Features, cfg: TrainConfig, seed: int) -> None:
        """EAGLE-1's feature augmentation: U(-a, a) noise, a = ``train.feature_noise``."""
        if not cfg.train.feature_noise:
            return
        device = features.hidden.device
        noise = torch.rand(features.hidden.shape, generator=torch.Generator(device).manual_seed(seed), device=device)
        features.noise = (2 * noise - 1) * cfg.train.feature_noise


OBJECTIVE = EagleObjective
