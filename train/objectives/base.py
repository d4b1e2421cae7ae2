"""What a head kind's training objective is: ``Objective``, the head and its loss in one module.

One module per kind, ``train/objectives/<kind>.py``, names its subclass ``OBJECTIVE``, and one per variant
with a class of its own, ``train/objectives/variants/<variant>.py``, a subclass of its kind's (see
``objective_class``). The loop calls only what is declared here.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.target.model import TargetOutput, causal_lm_of, target_forward
from draftsmith.train.settings import DEFAULT_TTT_STEPS, TrainConfig
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput


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
    tokenizer: Any = None  # the target's tokenizer (dflash checks its mask token against it)


def objective_class(kind: str, variant: str | None = None) -> type[Objective]:
    """The training objective of head kind ``kind`` (module ``train.objectives.<kind>``, ``-`` read as ``_``), or of
    its ``variant`` where that has a class of its own (``heads.kinds.VARIANT_CLASSES``: module
    ``train.objectives.variants.<variant>``)."""
    from draftsmith.heads.kinds import HEAD_CLASSES, VARIANT_CLASSES

    if kind not in HEAD_CLASSES:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(HEAD_CLASSES)}")
    if (kind, variant) in VARIANT_CLASSES:
        return importlib.import_module(f"draftsmith.train.objectives.variants.{variant}").OBJECTIVE
    return importlib.import_module(f"draftsmith.train.objectives.{kind.replace('-', '_')}").OBJECTIVE


class Objective(nn.Module):
    """The head and its training loss in one forward, so DDP wraps a single call per backward.

    The target's frozen lm_head is passed in per call so it is never part of this module's
    parameters, state dict or checkpoints.
    """

    # The settings this kind reads that not every kind does, as a user writes them: "head.<key>" (a head.* key
    # its objective reads, not its head config: never passed to heads.build_head), "train.<key>" (read when set
    # away from its default) or "train.<key>=<value>". train/config.py derives from these which kinds take each
    # setting and refuses it, naming them, under any other kind.
    reads: tuple[str, ...] = ()

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        """Fill this kind's training defaults in ``cfg`` and check its combinations, at parse time
        (``train.config.load_config``, after every check that names no kind); a problem raises
        ``ConfigError`` naming the key."""

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
    def aux_layer_ids(head: nn.Module) -> tuple[int, ...]:
        """The target layers whose entering hidden states this kind reads (HF ``hidden_states`` indices)."""
        return ()

    @classmethod
    @torch.no_grad()
    def features(cls, target: nn.Module, batch: dict, head: nn.Module, need_top1: bool = False,
                 states: TargetOutput | None = None) -> Features:
        """Run the frozen target once over ``batch`` and keep only what this kind's head reads
        (``top1``, the target's argmax, too when ``need_top1``). ``states``: this batch's hidden states
        stored earlier (``data.features``); the target's forward is then skipped."""
        if states is None:
            states = target_forward(target, batch["input_ids"], aux_layer_ids=cls.aux_layer_ids(head),
                                    compute_logits=False)
        return cls.from_states(target, batch, states, head, need_top1)

    @staticmethod
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        """``Features`` from the target's final (and aux) hidden states alone: logits come from the frozen
        lm_head, embeddings from the target's table, so stored states need no decoder layer."""
        raise NotImplementedError

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        raise NotImplementedError

    @staticmethod
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        """(K, B, T) target-vocab ids the head drafts at steps 0..depth-1 of every position."""
        raise NotImplementedError

    @staticmethod
    def fit_draft_temperature(head: nn.Module, features: Features, depth: int, fit) -> bool:
        """Add this batch's held-out positions to ``fit`` (``train.draft_temperature.DraftTemperatureFit``) at draft
        depths 0..depth-1; False when the kind's drafter has no draft temperature (nothing added)."""
        return False

    @staticmethod
    def prepare_head(head: nn.Module, setup: HeadSetup) -> Any:
        """Finish a fresh head before training (a draft vocabulary, an init from the target); returns
        a report for the run's card, or None."""
        return None

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        """How many draft steps evaluation simulates."""
        return cfg.train.eval_depth or DEFAULT_TTT_STEPS

    def at_step(self, step: int, max_steps: int) -> None:
        """Called by the loop before optimizer step ``step`` (0-based) of ``max_steps``, resumed runs included:
        for losses scheduled over the run (Domino's base weight)."""

    def perturb(self, features: Features, cfg: TrainConfig, seed: int) -> None:
        """Augment ``features`` in place before the forward (reproducibly from ``seed``)."""

    def rollout(self, features: Features, target: nn.Module, cfg: TrainConfig, seed: int) -> None:
        """``train.stage=on-policy``: draft chains with the head, verify them with ``target`` and set
        ``features.rollout`` (``train.on_policy``); the kinds whose ``reads`` hold ``train.stage=on-policy``
        define it."""
        raise NotImplementedError(f"{type(self).__name__} has no on-policy stage")


@torch.no_grad()
def target_logits(target: nn.Module, final_hidden: Tensor) -> Tensor:
    """(B, T, V) the target's logits from its post-norm final hidden states (its frozen lm_head)."""
    lm_head = causal_lm_of(target).get_output_embeddings()
    return lm_head(final_hidden.to(lm_head.weight.dtype))


@torch.no_grad()
def no_grad_embeds(target: nn.Module, input_ids: Tensor) -> Tensor:
    """The target's input embeddings of ``input_ids`` in float32."""
    return target.get_input_embeddings()(input_ids).float()
