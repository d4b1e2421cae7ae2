"""EAGLE-3: training-time test over the target's fused aux features; soft labels from the target's
distribution restricted to the draft vocabulary, or its top-1 there (``train.labels``); optional init from the
target's output layer. P-EAGLE (``head.variant=peagle``, a subclass of this objective): its depths in one forward
over COD-sampled rollouts
(``train.objectives.variants.peagle``)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.target.model import TargetOutput
from draftsmith.train.settings import DEFAULT_TTT_STEPS, ConfigError, TrainConfig
from draftsmith.train.draft_vocab import build_draft_vocab
from draftsmith.train.examples import collate
from draftsmith.train.features import Features
from draftsmith.train.anchors import draw_anchors
from draftsmith.train.losses import (DraftTargets, LossOutput, decayed_sum, dpace_weights, restrict_to_draft_vocab, soft_ce,
                          law_step_loss, mixed_labels, top1_labels, ttt_step_loss, ttt_step_view, weighted_mean)

from draftsmith.train.objectives.base import HeadSetup, Objective, no_grad_embeds, target_logits
from draftsmith.train.on_policy import Rollout, on_policy_output, verify_drafts
from draftsmith.train.unroll import unroll

logger = logging.getLogger("draftsmith.train")


@dataclass(kw_only=True)
class Eagle3Features(Features):
    embeds: Tensor  # (B, T, H_t) the target's input embeddings, fp32
    targets: DraftTargets  # (B, T, Vd) soft labels on the draft vocabulary + the target's top-1


class Eagle3Objective(Objective):
    reads = ("head.ttt_steps", "head.init_from_target", "train.loss=dpace", "train.stage=on-policy",
             "train.mask_out_of_vocab", "train.freeze_lm_head", "train.labels", "train.top1_share", "train.law_weight")

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        if cfg.head.ttt_steps is None:
            cfg.head.ttt_steps = DEFAULT_TTT_STEPS
        if cfg.head.init_from_target is None:
            cfg.head.init_from_target = True
        mixed = cfg.train.labels == "top1" or cfg.train.top1_share is not None
        if mixed and cfg.train.stage == "on-policy":
            setting = "train.labels=top1" if cfg.train.labels == "top1" else f"train.top1_share={cfg.train.top1_share}"
            raise ConfigError(f"{setting} trains the supervised stage; the on-policy stage learns the target's law "
                              "after the drafted prefix (forward and reverse KL): leave train.labels=soft alone with it")
        if cfg.train.top1_share is not None and cfg.train.labels == "top1":
            raise ConfigError(f"train.top1_share={cfg.train.top1_share} mixes the top-1 into soft labels; "
                              "train.labels=top1 is the top-1 alone")
        if cfg.train.law_weight is not None and cfg.train.labels != "top1":
            raise ConfigError(f"train.law_weight={cfg.train.law_weight} adds the law at the logits' own temperature to "
                              "train.labels=top1; with soft labels the law is the label already")
        if cfg.train.law_weight is not None and not cfg.train.law_weight > 0:
            raise ConfigError(f"train.law_weight={cfg.train.law_weight}: the law term's weight is > 0 (null = none)")
        if cfg.train.law_weight is not None and cfg.train.loss == "dpace":
            raise ConfigError(f"train.law_weight={cfg.train.law_weight} is not defined with train.loss=dpace")
        if cfg.train.top1_share is not None and not 0 < cfg.train.top1_share < 1:
            raise ConfigError(f"train.top1_share={cfg.train.top1_share}: the top-1's share is in (0, 1) (1 is "
                              "train.labels=top1)")

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.ttt_steps = cfg.head.ttt_steps
        self.loss, self.alpha = cfg.train.loss, cfg.train.dpace_alpha
        self.anchors, self.spacing = cfg.train.anchors_per_document, cfg.train.anchor_spacing
        self.mask_out_of_vocab, self.labels = cfg.train.mask_out_of_vocab, cfg.train.labels
        self.top1_share, self.law_weight = cfg.train.top1_share, cfg.train.law_weight

    @staticmethod
    def aux_layer_ids(head: nn.Module) -> tuple[int, ...]:
        return tuple(head.feature_layer_ids)

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        ids = batch["input_ids"]  # full logits dropped once restricted
        targets = restrict_to_draft_vocab(target_logits(target, states.final_hidden), getattr(head, "t2d", None))
        return Eagle3Features(input_ids=ids, loss_mask=batch["loss_mask"], hidden=states.aux_hidden.float(),
                              embeds=no_grad_embeds(target, ids), targets=targets, top1=targets.top1)

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features
        if f.rollout is not None:
            return self.on_policy_forward(f)
        if not self.mask_out_of_vocab:  # every position trains, on the target's law renormalised over the draft vocab
            f = dataclasses.replace(f, targets=f.targets._replace(in_vocab=torch.ones_like(f.targets.in_vocab)))
        law = f.targets if self.law_weight is not None else None
        if self.labels == "top1":  # the law's top-1 over the draft vocabulary, one-hot: greedy verification's event
            f = dataclasses.replace(f, targets=f.targets._replace(probs=top1_labels(f.targets.probs)))
        elif self.top1_share is not None:  # the law and its top-1, for greedy and sampled verification alike
            f = dataclasses.replace(f, targets=f.targets._replace(probs=mixed_labels(f.targets.probs, self.top1_share)))
        return self.supervised_forward(f, law)

    def supervised_forward(self, f: Features, law: DraftTargets | None = None) -> LossOutput:
        """The supervised loss over labels as ``forward`` set them: the TTT steps' (P-EAGLE's objective: its
        depths'); with ``law`` (``train.law_weight``) each step adds the law's soft CE at its logits' temperature."""
        outs = unroll(self.head, self.head.project(f.hidden), f.embeds, self.ttt_steps)
        if self.loss == "dpace":
            return self.dpace_forward(f, [self.head.compute_logits(out) for out in outs])
        steps = []
        for k, out in enumerate(outs):
            logits = self.head.compute_logits(out)
            step = ttt_step_loss(logits, f.targets, f.loss_mask, k, self.loss)
            if law is not None:
                total = step.loss + self.law_weight * law_step_loss(logits, law, f.loss_mask, k, self.loss)
                step = step._replace(loss=total, step_losses=total.detach()[None])
            steps.append(step)
        return LossOutput(decayed_sum([s.loss for s in steps], self.decay),
                          *(torch.cat([getattr(s, n) for s in steps]) for n in ("step_losses", "correct", "count",
                                                                                 "accept")))

    def dpace_forward(self, f: Features, step_logits: list[Tensor]) -> LossOutput:
        """D-PACE over each position's chain of TTT steps: step k at position i is chain position k."""
        seq_len = f.input_ids.shape[1]
        n = max(seq_len - 2, 0)
        elements = torch.zeros(len(step_logits), f.input_ids.shape[0], n, device=f.input_ids.device)  # (K, B, n)
        confidence, valid = torch.zeros_like(elements), torch.zeros_like(elements, dtype=torch.bool)
        stats = []
        for k, logits in enumerate(step_logits):
            out = ttt_step_loss(logits, f.targets, f.loss_mask, k, "ce")
            logits, probs, mask = ttt_step_view(logits, f.targets, f.loss_mask, k)  # (B, n-k, Vd)
            m = logits.shape[1]
            elements[k, :, :m] = soft_ce(logits, probs)
            confidence[k, :, :m] = logits.detach().softmax(-1).gather(-1, probs.argmax(-1, keepdim=True))[..., 0]
            valid[k, :, :m] = mask
            stats.append(out)
        weights = dpace_weights(confidence.permute(1, 2, 0), valid.permute(1, 2, 0), self.alpha)  # (B, n, K)
        total = weighted_mean(elements.permute(1, 2, 0), weights)
        return LossOutput(total, *(torch.cat([getattr(s, n) for s in stats])
                                   for n in ("step_losses", "correct", "count", "accept")))

    @torch.no_grad()
    def rollout(self, features: Features, target: nn.Module, cfg: TrainConfig, seed: int) -> None:
        """On-policy stage: roots drawn as DFlash's anchors (root token a = position i+1), every position's
        chain drafted with the head's own tokens as the next step's input, the drawn chains verified."""
        f = features
        generator = torch.Generator(f.loss_mask.device).manual_seed(seed)
        roots, keep = draw_anchors(f.loss_mask, self.anchors, generator, spacing=self.spacing)
        drafts, embeds = [], []
        embed_table = target.get_input_embeddings()

        def drafted(k: int, previous: Tensor) -> Tensor:
            return embeds[k - 1]

        for out in unroll(self.head, self.head.project(f.hidden), f.embeds, self.ttt_steps, drafted):
            drafts.append(self.head.draft_to_target(self.head.compute_logits(out).argmax(-1)))  # (B, T)
            embeds.append(embed_table(drafts[-1]).float())
        at_roots = torch.stack(drafts, -1).gather(1, (roots - 1)[..., None].expand(-1, -1, len(drafts)))  # (B, N, K)
        logits = verify_drafts(target, f.input_ids, roots, at_roots)  # (B, N, K, V)
        targets = restrict_to_draft_vocab(logits, getattr(self.head, "t2d", None))
        f.rollout = Rollout(roots, keep, at_roots, targets.probs.clamp(min=1e-30).log(), logits.argmax(-1),
                            torch.stack(embeds[:-1]) if len(embeds) > 1 else None)

    def on_policy_forward(self, f: Features) -> LossOutput:
        """The drafted chains again, with grad: step k >= 1 reads the embeddings of step k-1's drafts."""
        r = f.rollout
        outs = list(unroll(self.head, self.head.project(f.hidden), f.embeds, self.ttt_steps,
                           lambda k, previous: r.step_embeds[k - 1]))
        index = (r.roots - 1)[..., None]  # (B, N, 1): chain position k of root a is step k at position a-1

        def logits_at(k: int) -> Tensor:
            at = outs[k].gather(1, index.expand(-1, -1, outs[k].shape[-1]))  # (B, N, H)
            return self.head.compute_logits(at).float()

        return on_policy_output(logits_at, r, self.decay, self.head.draft_to_target)

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        return torch.stack([head.draft_to_target(head.compute_logits(out).argmax(-1))
                            for out in unroll(head, head.project(features.hidden), features.embeds, depth)])

    @staticmethod
    @torch.no_grad()
    def fit_draft_temperature(head: nn.Module, features: Features, depth: int, fit) -> bool:
        """Each unrolled step's logits against the target's law at the positions training scores (EAGLE-3's
        chain drafter reads the fit; P-EAGLE drafts its depths in one forward and does not)."""
        if head.config.variant != "eagle3":
            return False
        for k, out in enumerate(unroll(head, head.project(features.hidden), features.embeds, depth)):
            fit.add(k, *ttt_step_view(head.compute_logits(out), features.targets, features.loss_mask, k))
        return True

    @classmethod
    def prepare_head(cls, head: nn.Module, setup: HeadSetup):
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
        cls.start_variant_inputs(head, setup)
        if setup.cfg.head.init_from_target:
            temper = start_from_target(head, setup)
            logger.info("EAGLE-3 norm and lm_head start from the target's final norm%s and lm_head rows",
                        "" if temper == 1 else f" (tempered x{temper:g})")
        if setup.cfg.train.freeze_lm_head:  # before the optimizer is built: AdamW never steps a param without grad
            head.lm_head.requires_grad_(False)
            logger.info("EAGLE-3 lm_head frozen where it starts (train.freeze_lm_head)")
        return report

    @staticmethod
    def start_variant_inputs(head: nn.Module, setup: HeadSetup) -> None:
        """A variant's own inputs' start, before the head starts from the target (none for EAGLE-3)."""

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        return cfg.train.eval_depth or cfg.head.ttt_steps


TEMPERS = tuple(0.5 ** i for i in range(7))  # 1 ... 1/64
# How much worse than a random head's the first loss may start. On the demo target the untempered copy
# starts 3% above a random head (28.43 vs 27.56) and trains to simulated τ 1.498 in 200 steps, against
# 1.338 random and 1.332 when tempered (x0.25) down to the random head's loss (docs/benchmarks.md); a
# target with final-norm weights in the hundreds started 28x above it and gets tempered.
FIRST_LOSS_BOUND = 1.1
PROBE_ROWS = 4


@torch.no_grad()
def start_from_target(head: nn.Module, setup: HeadSetup) -> float:
    """``head.init_from_target`` with the largest temper (1, 1/2, ... 1/64) whose loss on the first
    training rows is within ``FIRST_LOSS_BOUND`` of the random head's; the random ``norm``/``lm_head``
    are kept when none is. Measured on every run, not assumed: the same copy is a good start on one
    target and a 28x worse one on another. Returns the temper (0.0: not started from the target)."""
    rows = [setup.train_set[i] for i in range(min(PROBE_ROWS, len(setup.train_set)))]
    batch = {k: v.to(setup.target.device) for k, v in collate(rows, pad_id=0).items()}
    device = head.lm_head.weight.device
    head.to(setup.target.device)
    try:
        objective = Eagle3Objective(head, setup.cfg)  # P-EAGLE's for a P-EAGLE head (Objective.__new__)
        features = objective.features(setup.target, batch, head)
        lm_head = setup.target.get_output_embeddings()
        saved = {k: v.clone() for k, v in head.state_dict().items() if k.startswith(("norm.", "lm_head."))}
        random_loss = float(objective(features, lm_head).loss)
        losses = {}
        for temper in TEMPERS:
            head.init_from_target(setup.target, temper)
            losses[temper] = float(objective(features, lm_head).loss)
        chosen = next((t for t in TEMPERS if losses[t] <= FIRST_LOSS_BOUND * random_loss), 0.0)
        logger.info("EAGLE-3 start, first-rows loss by temper: %s; random head %.3f -> %s",
                    " ".join(f"{t:g}:{v:.3f}" for t, v in losses.items()), random_loss,
                    f"temper {chosen:g}" if chosen else "the random norm and lm_head")
        if chosen:
            head.init_from_target(setup.target, chosen)
        else:
            head.load_state_dict(saved, strict=False)
        return chosen
    finally:
        head.to(device)


OBJECTIVE = Eagle3Objective
