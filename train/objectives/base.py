"""What a head kind's training objective is: ``Objective``, the head and its loss in one module.

One module per kind, ``train/objectives/<kind>.py``, names its subclass ``OBJECTIVE`` (see
``train.objectives.objective_class``). The loop calls only what is declared here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from train.config import DEFAULT_TTT_STEPS, TrainConfig
from train.features import Features
from train.losses import LossOutput


@dataclass
class HeadSetup:
    """What a kind may read while it prepares a fresh head (``Objective.prepare_head``)."""

    accelerator: Any
    cfg: TrainConfig
    target: nn.Module
    train_set: Any  # datasets.Dataset of input_ids / loss_mask
    data_key: str  # names the tokenized training data (its cache entry)
    vocab_size: int
    cache_dir: Any  # pathlib.Path of the run's cache


class Objective(nn.Module):
    """The head and its training loss in one forward, so DDP wraps a single call per backward.

    The target's frozen lm_head is passed in per call so it is never part of this module's
    parameters, state dict or checkpoints.
    """

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__()
        self.head = head
        self.decay = cfg.train.loss_decay
        self.backbone: nn.Module | None = None  # trainable adapters on the target (Medusa-2), else None

    def attach_backbone(self, target: nn.Module) -> None:
        """Make part of ``target`` trainable with the head when the config asks (Medusa-2's LoRA sets
        ``self.backbone``); by default the target stays frozen."""

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups: the head at train.lr (and a backbone at its own lr)."""
        return [{"params": list(self.head.parameters())}]

    @staticmethod
    def features(target: nn.Module, batch: dict, head: nn.Module, need_top1: bool = False) -> Features:
        """Run the frozen target once over ``batch`` and keep only what this kind's head reads
        (``top1``, the target's argmax, too when ``need_top1``)."""
        raise NotImplementedError

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        raise NotImplementedError

    @staticmethod
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        """(K, B, T) target-vocab ids the head drafts at steps 0..depth-1 of every position."""
        raise NotImplementedError

    @staticmethod
    def prepare_head(head: nn.Module, setup: HeadSetup) -> Any:
        """Finish a fresh head before training (a draft vocabulary, an init from the target); returns
        a report for the run's card, or None."""
        return None

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        """How many draft steps evaluation simulates."""
        return cfg.train.eval_depth or DEFAULT_TTT_STEPS

    def perturb(self, features: Features, cfg: TrainConfig, seed: int) -> None:
        """Augment ``features`` in place before the forward (reproducibly from ``seed``)."""


@torch.no_grad()
def no_grad_embeds(target: nn.Module, input_ids: Tensor) -> Tensor:
    """The target's input embeddings of ``input_ids`` in float32."""
    return target.get_input_embeddings()(input_ids).float()
