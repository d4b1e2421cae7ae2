"""P-EAGLE's training (``head.variant=peagle`` on EAGLE-3, read by the EAGLE-3 objective; arXiv 2602.01469 and the
speculators library's ``PEagleDraftModel``, docs/objectives.md, "P-EAGLE").

Depth 0 is EAGLE-3's first step at every position i (the target's features of token i, the embedding of token
i+1, RoPE position i) and drafts token i+2. The rollout of anchor i at depth d (1..K-1) is a mask position
(``heads.variants.peagle.mask_inputs``) at RoPE position i+d drafting token i+2+d: it attends to depth 0 at positions
<= i and to its own rollout's depths 1..d, exactly what the drafter's one forward gives the mask after the
last accepted token i. Every depth trains on the target's law at its token, as EAGLE-3's step d does
(``ttt_step_loss``'s soft labels and loss kinds, steps weighted by ``train.loss_decay``).

COD sampling (conditional-on-distribution) keeps this affordable: depth 0 holds every position, depth d a random
subset of about max(0.7^d, 0.2) of the valid anchors, drawn among the anchors whose rollout reached depth d-1
and whose depth-d token is a training target. All depths run as ONE head forward over the concatenated
sequence under the mask above (speculators' ``create_peagle_mask_mod``), with rows padded per depth.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.heads.layers import additive_mask
from draftsmith.heads.mask_token import check_mask_token
from draftsmith.heads.variants.peagle import COD_RATIO, COD_RATIO_MIN, mask_inputs
from draftsmith.target.model import TargetOutput
from draftsmith.train.features import Features
from draftsmith.train.losses import DraftTargets, LossOutput, acceptance_rate, decayed_sum, soft_loss, ttt_step_loss
from draftsmith.train.objectives.base import HeadSetup
from draftsmith.train.objectives.eagle3 import Eagle3Features, Eagle3Objective
from draftsmith.train.settings import ConfigError, TrainConfig
from draftsmith.train.unroll import shift_left

Rollouts = list[tuple[Tensor, Tensor]]  # per depth 1.. : anchors (B, n_d) long, valid (B, n_d) bool


def _label_valid(loss_mask: Tensor, depth: int) -> Tensor:
    """(B, T) whether anchor i's depth-``depth`` token i+2+depth is a training target inside the row."""
    return shift_left(loss_mask.bool(), 2 + depth)


def cod_rollouts(loss_mask: Tensor, depths: int, generator: torch.Generator | None,
                 ratio: float = COD_RATIO, floor: float = COD_RATIO_MIN) -> Rollouts:
    """COD sampling: per depth 1..depths-1, each row's sampled anchors (ascending, padded) and which are real.
    ``ratio`` 1 keeps every valid anchor at every depth (evaluation)."""
    alive = _label_valid(loss_mask, 0)
    n_valid = loss_mask.bool().sum(1)  # (B,)
    out: Rollouts = []
    for d in range(1, depths):
        candidates = alive & _label_valid(loss_mask, d)
        size = ((n_valid - d).clamp(min=0).double() * max(ratio ** d, floor)).long()  # (B,) speculators' int()
        scores = torch.rand(candidates.shape, generator=generator, device=loss_mask.device)
        scores = scores.masked_fill(~candidates, 2.0)
        rank = scores.argsort(1).argsort(1)
        chosen = candidates & (rank < size[:, None])
        counts = chosen.sum(1)
        width = int(counts.max())
        if width == 0:
            break
        order = torch.sort((~chosen).int(), dim=1, stable=True).indices  # chosen anchors first, in order
        out.append((order[:, :width], torch.arange(width, device=order.device)[None] < counts[:, None]))
        alive = chosen
    return out


def all_rollouts(loss_mask: Tensor, depths: int) -> Rollouts:
    """Every anchor at every depth (what the drafter drafts after each position): evaluation's rollouts."""
    batch, seq_len = loss_mask.shape
    anchors = torch.arange(seq_len, device=loss_mask.device).expand(batch, -1)
    return [(anchors, torch.ones_like(anchors, dtype=torch.bool)) for _ in range(1, depths)]


def parallel_outputs(head: nn.Module, hidden: Tensor, embeds: Tensor, rollouts: Rollouts) -> list[Tensor]:
    """The head's outputs per depth, [(B, T, H) depth 0, (B, n_d, H) depth d...], from one forward over depth 0
    (``hidden`` (B, T, n·H_t) the target's aux features, ``embeds`` (B, T, H) its embeddings) and the rollouts'
    mask positions."""
    batch, seq_len, _ = hidden.shape
    device = hidden.device
    anchor = [torch.arange(seq_len, device=device).expand(batch, -1)] + [a for a, _ in rollouts]
    depth = [torch.full_like(a, d) for d, a in enumerate(anchor)]
    valid = [torch.ones_like(anchor[0], dtype=torch.bool)] + [v for _, v in rollouts]
    anchor, depth, valid = torch.cat(anchor, 1), torch.cat(depth, 1), torch.cat(valid, 1)  # (B, S)
    masks = anchor.shape[1] - seq_len
    fused = head.project(hidden)
    mask_hidden, mask_embeds = mask_inputs(head, batch, masks, fused.dtype)
    q, k = (slice(None), slice(None), None), (slice(None), None, slice(None))
    allowed = (depth[k] == 0) & (anchor[k] <= anchor[q])  # the accepted context up to the rollout's anchor
    allowed |= (anchor[k] == anchor[q]) & (depth[k] >= 1) & (depth[k] <= depth[q]) & valid[k]  # its own masks
    allowed |= torch.eye(anchor.shape[1], dtype=torch.bool, device=device)
    out = head(hidden_states=torch.cat([fused, mask_hidden], 1),
               inputs_embeds=torch.cat([shift_left(embeds, 1).to(fused.dtype), mask_embeds], 1),
               position_ids=anchor + depth,
               attention_mask=additive_mask(allowed, fused.dtype)[0, 0][:, None]).hidden_states
    sizes = [seq_len] + [a.shape[1] for a, _ in rollouts]
    return list(out.split(sizes, dim=1))


def depth_loss(logits: Tensor, targets: DraftTargets, loss_mask: Tensor, anchors: Tensor, valid: Tensor,
               depth: int, loss: str) -> LossOutput:
    """``ttt_step_loss`` of depth ``depth``'s logits (B, n, Vd) at its sampled ``anchors`` (B, n): the target's law
    at anchor + 1 + depth, trained where token anchor + 2 + depth is a training target."""
    seq_len = loss_mask.shape[1]
    at = (anchors + 1 + depth).clamp(max=seq_len - 1)
    probs = targets.probs.gather(1, at[..., None].expand(-1, -1, targets.probs.shape[-1]))
    label = _label_valid(loss_mask, depth).gather(1, anchors)
    mask = valid & label & targets.in_vocab.gather(1, at)
    value, n = soft_loss(logits, probs, mask, loss)
    correct = ((logits.argmax(-1) == probs.argmax(-1)) & mask).sum()
    accept = (acceptance_rate(logits.detach(), probs) * mask).sum()
    return LossOutput(value, value.detach()[None], correct.float()[None], n.float()[None], accept[None])


def peagle_losses(head: nn.Module, features, rollouts: Rollouts, loss: str) -> list[LossOutput]:
    """Each depth's ``LossOutput`` (depth 0 every position, depth d the rollouts sampled for it)."""
    f = features
    outs = parallel_outputs(head, f.hidden, f.embeds, rollouts)
    steps = [ttt_step_loss(head.compute_logits(outs[0]), f.targets, f.loss_mask, 0, loss)]
    for d, (out, (anchors, valid)) in enumerate(zip(outs[1:], rollouts), start=1):
        steps.append(depth_loss(head.compute_logits(out), f.targets, f.loss_mask, anchors, valid, d, loss))
    return steps


@torch.no_grad()
def parallel_top1(head: nn.Module, features, depth: int) -> Tensor:
    """(depth, B, T) target ids the head drafts at depth d after every position (its inference drafts)."""
    f = features
    outs = parallel_outputs(head, f.hidden, f.embeds, all_rollouts(f.loss_mask, depth))
    return torch.stack([head.draft_to_target(head.compute_logits(out).argmax(-1)) for out in outs])


@dataclass(kw_only=True)
class PEagleFeatures(Eagle3Features):
    rollouts: Rollouts | None = None  # this step's COD-sampled rollouts (``perturb``); None = drawn at seed 0


class PEagleObjective(Eagle3Objective):
    """EAGLE-3's objective with P-EAGLE's depths trained in one forward over COD-sampled rollouts."""

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        if cfg.train.loss == "dpace" or cfg.train.stage == "on-policy":
            raise ConfigError(f"head.variant=peagle trains its depths in one forward: train.loss=dpace and "
                              f"train.stage=on-policy (TTT chains) do not apply (train.loss={cfg.train.loss}, "
                              f"train.stage={cfg.train.stage})")
        if cfg.train.law_weight is not None:
            raise ConfigError(f"train.law_weight={cfg.train.law_weight} is EAGLE-3's chain recipe (its drafter's fitted "
                              "draft temperature); head.variant=peagle does not take it")
        super().configure(cfg)

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        features = Eagle3Objective.from_states(target, batch, states, head, need_top1)
        return PEagleFeatures(**{f.name: getattr(features, f.name) for f in dataclasses.fields(features)})

    def supervised_forward(self, f: Features, law: DraftTargets | None = None) -> LossOutput:
        """P-EAGLE's depths in one forward (``law`` is never given: ``configure`` refuses ``train.law_weight``)."""
        rollouts = getattr(f, "rollouts", None)
        steps = peagle_losses(self.head, f, rollouts if rollouts is not None else self.draw_rollouts(f, 0), self.loss)
        return LossOutput(decayed_sum([s.loss for s in steps], self.decay),
                          *(torch.cat([getattr(s, n) for s in steps]) for n in ("step_losses", "correct", "count",
                                                                                 "accept")))

    def perturb(self, features: Features, cfg: TrainConfig, seed: int) -> None:
        """This step's COD rollouts, drawn from ``seed``."""
        features.rollouts = self.draw_rollouts(features, seed)

    def draw_rollouts(self, features: Features, seed: int) -> Rollouts:
        generator = torch.Generator(features.loss_mask.device).manual_seed(seed)
        return cod_rollouts(features.loss_mask, self.head.config.num_depths, generator)

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        return parallel_top1(head, features, depth)

    @staticmethod
    def start_variant_inputs(head: nn.Module, setup: HeadSetup) -> None:
        """The mask token checked against the target (not pad/EOS/BOS: ``check_mask_token``, as DFlash's); the mask
        embedding starts as the target's embedding of it."""
        check_mask_token(head.config.mask_token_id, setup.target, setup.tokenizer)
        with torch.no_grad():
            row = setup.target.get_input_embeddings().weight[head.config.mask_token_id]
            head.mask_embedding.copy_(row.to(head.mask_embedding))

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        return cfg.train.eval_depth or head.config.num_depths


OBJECTIVE = PEagleObjective
