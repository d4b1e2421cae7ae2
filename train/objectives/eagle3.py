"""EAGLE-3: training-time test over the target's fused aux features; soft labels from the target's
distribution restricted to the draft vocabulary; optional init from the target's output layer."""
from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from infer.target import target_forward
from train.config import TrainConfig
from train.draft_vocab import build_draft_vocab
from train.features import Features
from train.losses import LossOutput, decayed_sum, restrict_to_draft_vocab, ttt_step_loss
from train.objectives.base import HeadSetup, Objective, no_grad_embeds
from train.unroll import unroll

logger = logging.getLogger("draftsmith.train")


class Eagle3Objective(Objective):
    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.ttt_steps = cfg.head.ttt_steps
        self.loss = cfg.train.loss

    @staticmethod
    @torch.no_grad()
    def features(target: nn.Module, batch: dict, head: nn.Module, need_top1: bool = False) -> Features:
        ids = batch["input_ids"]
        out = target_forward(target, ids, aux_layer_ids=head.feature_layer_ids, compute_logits=True)
        targets = restrict_to_draft_vocab(out.logits, getattr(head, "t2d", None))  # full logits dropped here
        return Features(ids, batch["loss_mask"], out.aux_hidden.float(), no_grad_embeds(target, ids),
                        targets=targets, top1=targets.top1)

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features
        steps = [ttt_step_loss(self.head.compute_logits(out), f.targets, f.loss_mask, k, self.loss)
                 for k, out in enumerate(unroll(self.head, self.head.project(f.hidden), f.embeds, self.ttt_steps))]
        return LossOutput(decayed_sum([s.loss for s in steps], self.decay),
                          *(torch.cat([getattr(s, n) for s in steps]) for n in ("step_losses", "correct", "count")))

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        return torch.stack([head.draft_to_target(head.compute_logits(out).argmax(-1))
                            for out in unroll(head, head.project(features.hidden), features.embeds, depth)])

    @staticmethod
    def prepare_head(head: nn.Module, setup: HeadSetup):
        """A reduced draft vocabulary from the training data's targets; the target's final norm and
        lm_head rows as the head's starting point (``head.init_from_target``)."""
        report = None
        if head.config.reduced_vocab:
            with setup.accelerator.main_process_first():
                report = build_draft_vocab(setup.train_set, vocab_size=setup.vocab_size,
                                           size=head.config.draft_vocab_size, data_key=setup.data_key,
                                           cache_dir=setup.cache_dir / "draft_vocab")
            head.set_draft_vocab(report.ids)
            logger.info("draft vocab: %d of %d tokens cover %.1f%% of training targets (%s)",
                        head.config.draft_vocab_size, setup.vocab_size, 100 * report.coverage, report.cache_path)
        if setup.cfg.head.init_from_target:
            head.init_from_target(setup.target)
            logger.info("EAGLE-3 norm and lm_head start from the target's final norm and lm_head rows")
        return report

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        return cfg.train.eval_depth or cfg.head.ttt_steps


OBJECTIVE = Eagle3Objective
