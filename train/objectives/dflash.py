"""DFlash: blocks ``[t_a, MASK, ...]`` at random anchors a, all blocks of a sequence in one head
forward over context K/V built once per sequence; block position k (1..B-1) learns the target's
next-token distribution at a+k-1 (its prediction of token a+k) by soft cross-entropy (``train.loss=lk``:
LK^alpha, -log of the expected acceptance rate, instead; ``dpace``: D-PACE's weights).

A block sees the context strictly before its anchor (the anchor token's own features are not known
at inference: it is the token just emitted) within its own document, every position of its own block,
and no other block (SpecForge's ``create_dflash_block_mask``). Anchors are drawn per document and step
from ``perturb``'s seed (a resumed run draws the same ones): ``train.anchors_per_document`` of them, at
least ``train.anchor_spacing`` apart, where the anchor and its first label are both training targets
(SpecForge's rule). A block's label a+k is trained while the run of training targets from the anchor is
unbroken: it stops at the first loss-masked token and at the document's end (docs/dflash.md). Position
k's loss is weighted ``exp(-(k-1)/gamma)`` (the DFlash paper's decay; ``train.gamma``).

DFlash2 (``head.variant=dflash2``) adds SpecForge's selector loss (docs/objectives.md, "DFlash2's selector"):
at every trained block position, the cross-entropy of the selector's scores over the position's top-k
unary candidates, scored after the data's previous token, against the index of the target's greedy token
among them (the base loss learns the target's law, not the data's: docs/dflash.md); positions whose
target token is not a candidate carry none. It is summed with the same position decay and
the same denominators as the base loss and added with weight ``SELECTOR_ALPHA``.

DSpark (``head.variant=dspark``): every slot of the block drafts (slot k the token a+k+1), corrected by the
Markov head, and the loss is DeepSpec's (``train.objectives.variants.dspark``, a subclass of this objective) on
the same anchors and blocks.

Domino (``head.variant=domino``): every slot drafts (slot k the token a+k+1), corrected by the GRU over the data's
tokens a..a+k, and the loss is SpecForge's λ-blend of the corrected and the plain logits' CE
(``train.objectives.variants.domino``, a subclass of this objective), λ set per step from the run's progress
(``at_step``).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from draftsmith.heads.dflash import DEFAULT_BLOCK_SIZE, check_mask_token  # noqa: F401  (tests import it here)
from draftsmith.infer.drafters.base import Sampling
from draftsmith.infer.drafters.dflash import select_path
from draftsmith.target.model import TargetOutput
from draftsmith.train.settings import ConfigError, OptimConfig, TrainConfig
from draftsmith.train.features import Features
from draftsmith.train.losses import LossOutput, decayed_sum, dpace_weights, soft_ce, soft_loss, weighted_mean
from draftsmith.train.metrics import acceptance_rate
from draftsmith.train.objectives.base import HeadSetup, Objective, no_grad_embeds
from draftsmith.train.anchors import draw_anchors, segments
from draftsmith.train.objectives.eagle3 import Eagle3Features, Eagle3Objective
from draftsmith.train.on_policy import Rollout, on_policy_output, verify_drafts

EVAL_CHUNK = 32  # anchors per head forward at evaluation (every position is one): bounds (B, C, depth, V) logits
# The DFlash paper's decay exp(-(k-1)/gamma) by block size, as ModelOpt's DFlash guide quotes it: 7 for
# blocks of 16, 4 for blocks of 8 (docs/dflash.md)
PAPER_GAMMA = {16: 7.0, 8: 4.0}
# What the on-policy stage (DFlash's) would leave untrained in DFlash2 (the variants with classes of their own
# say theirs: ``DFlashObjective.untrained_on_policy``)
ON_POLICY_REFUSED = {"dflash2": "DFlash2's selector"}
SELECTOR_ALPHA = 1.0  # DFlash2's selector loss weight: SpecForge's dflash2_selector_loss_alpha default


def default_gamma(block_size: int) -> float:
    """The paper's gamma: 4 for blocks of up to 8 tokens, 7 above."""
    return PAPER_GAMMA[8] if block_size <= 8 else PAPER_GAMMA[16]


def block_labels(loss_mask: Tensor, anchors: Tensor, keep: Tensor, block_size: int,
                 document_ids: Tensor | None = None) -> Tensor:
    """(B, N, bs) bool: block position k of the block at anchor a is trained (k >= 1, a+k inside the row, in
    the anchor's run of training targets)."""
    seq_len = loss_mask.shape[1]
    seg = segments(loss_mask, document_ids)
    label = anchors[..., None] + torch.arange(block_size, device=anchors.device)  # (B, N, bs)
    inside = label < seq_len
    same = seg.gather(1, label.clamp(max=seq_len - 1).flatten(1)).view(label.shape) == seg.gather(1, anchors)[..., None]
    trained = keep[..., None] & inside & same
    trained[..., 0] = False  # the anchor is given, not drafted
    return trained


def slot_indices(anchors: Tensor, block_size: int, seq_len: int) -> Tensor:
    """(B, N, bs) the position a+k whose next token slot k drafts (clamped into the row)."""
    return (anchors[..., None] + torch.arange(block_size, device=anchors.device)).clamp(max=seq_len - 1)


def gather_slots(values: Tensor, at: Tensor) -> Tensor:
    """values (B, T, ...) at positions at (B, N, bs) -> (B, N, bs, ...) (DSpark's and Domino's slots)."""
    flat = at.flatten(1)
    if values.dim() == 2:
        return values.gather(1, flat).view(at.shape)
    return values.gather(1, flat[..., None].expand(-1, -1, values.shape[-1])).view(*at.shape, -1)


def selector_ce(scores: Tensor, candidates: Tensor, gold: Tensor) -> tuple[Tensor, Tensor]:
    """(cross-entropy (...) of ``scores`` (..., K) over ``candidates`` (..., K) against ``gold`` (...), and
    whether gold is a candidate (...) bool). Where it is not, the cross-entropy is 0 (SpecForge's strict
    top-k: nothing to select there)."""
    hit = candidates == gold[..., None]  # (..., K)
    found = hit.any(-1)
    index = hit.float().argmax(-1)  # the gold's slot (0 where absent; masked out below)
    ce = torch.logsumexp(scores.float(), -1) - scores.float().gather(-1, index[..., None])[..., 0]
    return ce * found, found


def block_mask(anchors: Tensor, seq_len: int, block_size: int, dtype: torch.dtype,
               document_ids: Tensor | None = None) -> Tensor:
    """Additive (B, 1, N·bs, T + N·bs) mask: block n sees context t < anchors[n] of its anchor's document
    (``document_ids`` (B, T); None: the whole row) and its own block."""
    batch, n = anchors.shape
    device = anchors.device
    q_block = torch.arange(n * block_size, device=device) // block_size  # (Q,)
    starts = anchors.repeat_interleave(block_size, 1)  # (B, Q)
    context = torch.arange(seq_len, device=device)[None, None] < starts[..., None]  # (B, Q, T)
    if document_ids is not None:
        context &= document_ids[:, None, :] == document_ids.gather(1, starts)[..., None]
    own = q_block[:, None] == q_block[None, :]  # (Q, Q)
    allowed = torch.cat([context, own[None].expand(batch, -1, -1)], dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def block_outputs(head: nn.Module, features: Features, anchors: Tensor, context: list) -> Tensor:
    """The head's normed outputs (B, N, bs, H) of blocks ``[t_a, MASK...]`` at ``anchors`` (B, N)."""
    batch, n = anchors.shape
    bs = head.config.block_size
    seq_len = features.input_ids.shape[1]
    root = features.embeds.gather(1, anchors[..., None].expand(-1, -1, features.embeds.shape[-1]))  # (B, N, H)
    masks = features.mask_embed.to(root)[None, None, None].expand(batch, n, bs - 1, -1)
    embeds = torch.cat([root[:, :, None], masks], dim=2).reshape(batch, n * bs, -1)
    positions = (anchors[..., None] + torch.arange(bs, device=anchors.device)).reshape(batch, n * bs)
    mask = block_mask(anchors, seq_len, bs, embeds.dtype, features.document_ids)
    return head(embeds, positions, context, mask).view(batch, n, bs, -1)


def sequence_context(head: nn.Module, features: Features) -> list:
    batch, seq_len = features.input_ids.shape
    return head.context_kv(features.hidden, torch.arange(seq_len, device=features.hidden.device).expand(batch, -1))


@dataclasses.dataclass(kw_only=True)
class DFlashFeatures(Eagle3Features):
    mask_embed: Tensor  # (H_t,) the target's embedding of the head's mask token, fp32
    anchors: Tensor | None = None  # (B, N) block start positions drawn for this step (perturb)
    anchor_keep: Tensor | None = None  # (B, N) bool: which drawn anchors are real (rows differ in length)
    document_ids: Tensor | None = None  # (B, T) the document of each token in packed rows; None = one per row
    embedding: nn.Module | None = None  # Domino: the target's input embedding (evaluation embeds the head's drafts)


class DFlashObjective(Objective):
    reads = ("train.gamma", "train.loss=dpace", "train.stage=on-policy", "train.anchors_per_document",
             "train.anchor_spacing", "train.lambda_base_start", "train.lambda_base_decay_ratio")
    # settings read under one variant only (refused under the others)
    variant_settings = {"train.lambda_base_start": "domino", "train.lambda_base_decay_ratio": "domino"}
    # what the on-policy stage would leave untrained, and the loss a variant trains instead of train.loss (it reads
    # train.loss=ce only): None for DFlash; DSpark's and Domino's objectives (train/objectives/variants/) say theirs
    untrained_on_policy: str | None = None
    own_loss: str | None = None

    @classmethod
    def configure(cls, cfg: TrainConfig) -> None:
        """Block positions are weighted by train.gamma, not train.loss_decay; a block fits in an example."""
        head, opt = cfg.head, cfg.train
        if opt.loss_decay != OptimConfig.loss_decay:
            raise ConfigError(f"train.loss_decay={opt.loss_decay} is not read by head.kind=dflash: its block "
                              "positions are weighted exp(-(k-1)/train.gamma); set train.gamma")
        if (head.block_size or DEFAULT_BLOCK_SIZE) > cfg.data.max_length:
            raise ConfigError(f"head.block_size={head.block_size or DEFAULT_BLOCK_SIZE} exceeds "
                              f"data.max_length={cfg.data.max_length}; a block must fit in an example")
        untrained = cls.untrained_on_policy or ON_POLICY_REFUSED.get(head.variant)
        if untrained and opt.stage == "on-policy":
            raise ConfigError(f"train.stage=on-policy does not train {untrained} "
                              f"(head.variant={head.variant}); run it on a DFlash head")
        if cls.own_loss and opt.loss != "ce":
            raise ConfigError(f"train.loss={opt.loss} is not read by head.variant={head.variant}: it trains "
                              f"{cls.own_loss} (docs/dflash.md)")
        for setting, variant in cls.variant_settings.items():
            value = getattr(opt, setting.split(".")[1])
            if head.variant != variant and value is not None:
                raise ConfigError(f"{setting}={value} applies only to head.variant={variant} "
                                  f"(head.variant={head.variant or 'dflash'})")
            if value is not None and value < 0:
                raise ConfigError(f"{setting}={value} must be at least 0")

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        opt = cfg.train
        self.loss, self.alpha, self.stage = opt.loss, opt.dpace_alpha, opt.stage
        self.anchors, self.spacing = opt.anchors_per_document, opt.anchor_spacing
        self.gamma = opt.gamma or default_gamma(head.config.block_size)
        self.decay = math.exp(-1 / self.gamma)  # position k's weight decay ** (k-1)
        untrained = self.untrained_on_policy or ON_POLICY_REFUSED.get(head.config.variant)
        if untrained and self.stage == "on-policy":
            raise ValueError(f"train.stage=on-policy does not train {untrained} "
                             f"(head.variant={head.config.variant}); run it on a DFlash head")

    aux_layer_ids = staticmethod(Eagle3Objective.aux_layer_ids)

    def at_step(self, step: int, max_steps: int) -> None:
        """The run's progress, for a schedule (Domino's objective's base loss weight: ``follow_schedule``)."""
        self.follow_schedule(step, max_steps)

    def follow_schedule(self, step: int, max_steps: int) -> None:
        """Set what changes with the run's progress (nothing for DFlash)."""

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        """EAGLE-3's (the aux layers' hidden states, the embeddings, the target's own next-token law),
        the mask token's embedding, which fills every block position after the anchor, and the batch's
        ``document_ids`` when its rows are packed."""
        features = Eagle3Objective.from_states(target, batch, states, head)
        mask_id = torch.tensor([head.config.mask_token_id], device=features.input_ids.device)
        fields = {f.name: getattr(features, f.name) for f in dataclasses.fields(features)}
        return DFlashFeatures(**fields, mask_embed=no_grad_embeds(target, mask_id)[0],
                              document_ids=batch.get("document_ids"),
                              embedding=target.get_input_embeddings() if head.domino else None)

    @staticmethod
    def prepare_head(head: nn.Module, setup: HeadSetup):
        """Check the mask token against the target (fresh, warm-started and resumed heads alike)."""
        check_mask_token(head.config.mask_token_id, setup.target, setup.tokenizer)
        return None

    def perturb(self, features: Features, cfg: TrainConfig, seed: int) -> None:
        """Draw this step's anchors (from ``seed``: a resumed run draws the same)."""
        generator = torch.Generator(features.loss_mask.device).manual_seed(seed)
        features.anchors, features.anchor_keep = draw_anchors(
            features.loss_mask, self.anchors, generator, spacing=self.spacing, document_ids=features.document_ids)

    @torch.no_grad()
    def rollout(self, features: Features, target: nn.Module, cfg: TrainConfig, seed: int) -> None:
        """On-policy stage: the head drafts a block at every drawn anchor, the target verifies it."""
        f = features
        lm_head = target.get_output_embeddings()
        out = block_outputs(self.head, f, f.anchors, sequence_context(self.head, f))  # (B, N, bs, H)
        drafts = lm_head(out[:, :, 1:].to(lm_head.weight.dtype)).argmax(-1)  # (B, N, bs-1)
        logits = verify_drafts(target, f.input_ids, f.anchors, drafts)  # (B, N, bs-1, V)
        f.rollout = Rollout(f.anchors, f.anchor_keep, drafts, logits.log_softmax(-1), logits.argmax(-1))
        # The block reads the root and mask tokens only, never its drafts: after the first rejection its
        # positions train against the supervised law (the target's after the data's prefix), not the law
        # after its wrong drafts, which it cannot condition on (docs/objectives.md)
        bs, seq_len = self.head.config.block_size, f.input_ids.shape[1]
        at = (f.anchors[..., None] + torch.arange(bs - 1, device=f.anchors.device)).clamp(max=seq_len - 1)  # (B, N, bs-1)
        probs = f.targets.probs.gather(1, at.flatten(1)[..., None].expand(-1, -1, f.targets.probs.shape[-1]))
        f.rollout.after_rejection = probs.view(*at.shape, -1).clamp(min=1e-30).log()  # (B, N, bs-1, V)
        f.rollout.after_valid = block_labels(f.loss_mask, f.anchors, f.anchor_keep, bs, f.document_ids)[..., 1:]

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features
        if f.anchors is None:  # called without perturb (e.g. directly): a fixed draw
            self.perturb(f, None, seed=0)
        out = block_outputs(self.head, f, f.anchors, sequence_context(self.head, f))  # (B, N, bs, H)
        if f.rollout is not None:  # the on-policy stage: position k of the chain is block position k+1
            return on_policy_output(lambda k: lm_head(out[:, :, k + 1]).float(), f.rollout, self.decay)
        return self.block_loss(f, out, lm_head)

    def block_loss(self, f: Features, out: Tensor, lm_head: nn.Module) -> LossOutput:
        """The supervised loss of the blocks' outputs ``out`` (B, N, bs, H) at ``f.anchors``: block position k
        (1..bs-1) against the target's law at a+k-1 (DSpark's and Domino's objectives: their slots' losses)."""
        bs = self.head.config.block_size
        seq_len = f.input_ids.shape[1]
        trained = block_labels(f.loss_mask, f.anchors, f.anchor_keep, bs, f.document_ids)  # (B, N, bs)
        losses, elements, confidence, correct, count, accept, chosen = [], [], [], [], [], [], []
        selector = self.head.selector
        for k in range(1, bs):
            safe = (f.anchors + k).clamp(max=seq_len - 1)  # the token block position k drafts
            mask = trained[..., k]  # (B, N)
            probs = f.targets.probs.gather(1, (safe - 1)[..., None].expand(-1, -1, f.targets.probs.shape[-1]))
            logits = lm_head(out[:, :, k]).float()  # (B, N, V)
            top1 = f.top1.gather(1, safe - 1)
            pick = logits.argmax(-1)  # (B, N) the draft: the unary argmax, or DFlash2's teacher-forced choice
            if selector is not None:  # scored after the true previous token (the anchor's for k = 1)
                unary, candidates = logits.topk(selector.top_k, dim=-1)  # (B, N, K)
                scores = selector(out[:, :, k], f.input_ids.gather(1, safe - 1), candidates, unary)
                ce, _ = selector_ce(scores, candidates, top1)  # the target's token, as the base loss's law
                chosen.append((ce * mask).sum() / mask.sum().clamp(min=1))  # the base loss's denominator
                pick = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
            if self.loss == "dpace":
                elements.append(soft_ce(logits, probs))
                confidence.append(logits.detach().softmax(-1).gather(-1, top1[..., None])[..., 0])
                value = (elements[-1] * mask).sum().detach() / mask.sum().clamp(min=1)
                n = mask.sum().float()
            else:
                value, n = soft_loss(logits, probs, mask, self.loss)
            losses.append(value)
            correct.append(((pick == top1) & mask).sum().float())
            count.append(n)
            accept.append((acceptance_rate(logits.detach(), probs) * mask).sum())
        if self.loss == "dpace":  # weights over the block's positions 1..bs-1
            weights = dpace_weights(torch.stack(confidence, -1), trained[..., 1:], self.alpha)
            total = weighted_mean(torch.stack(elements, -1), weights)
        else:
            total = decayed_sum(losses, self.decay)
        if chosen:
            total = total + SELECTOR_ALPHA * decayed_sum(chosen, self.decay)
        return LossOutput(total, torch.stack(losses).detach(), torch.stack(correct), torch.stack(count),
                          torch.stack(accept))

    @classmethod
    @torch.no_grad()
    def draft_top1(cls, head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        """Position i's drafts: the block at anchor i+1 (context ``<= i``), its first ``depth`` drafting slots
        (DFlash's 1..depth, DSpark's and Domino's 0..depth-1), walked by ``greedy_block``."""
        batch, seq_len = features.input_ids.shape
        drafted = torch.zeros(depth, batch, seq_len, dtype=torch.long, device=features.input_ids.device)
        context = sequence_context(head, features)
        for start in range(0, seq_len - 1, EVAL_CHUNK):
            positions = torch.arange(start, min(start + EVAL_CHUNK, seq_len - 1), device=drafted.device)
            anchors = (positions + 1)[None].expand(batch, -1)
            first = head.config.first_draft_slot
            out = block_outputs(head, features, anchors, context)[:, :, first: first + depth]  # (B, C, depth, H)
            roots = features.input_ids.gather(1, anchors)  # (B, C)
            drafted[:, :, positions] = cls.greedy_block(head, features, out, roots, lm_head).permute(2, 0, 1)
        return drafted

    @staticmethod
    def greedy_block(head: nn.Module, features: Features, out: Tensor, roots: Tensor, lm_head: nn.Module) -> Tensor:
        """(B, C, depth) the greedy drafts of blocks' drafting slots ``out`` (B, C, depth, H) after ``roots``
        (B, C): each slot's argmax, or DFlash2's selector walk as the drafter walks it (DSpark's and Domino's
        objectives: their walks)."""
        logits = lm_head(out).float()
        if head.selector is None:
            return logits.argmax(-1)
        path, _ = select_path(head.selector, out.flatten(0, 1), logits.flatten(0, 1), roots.flatten(), Sampling())
        return path.view(*roots.shape, -1)

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        most = head.config.drafts_per_block
        depth = cfg.train.eval_depth or most
        if depth > most:
            raise ValueError(f"train.eval_depth={depth} exceeds the {most} drafts of the {head.title} head's "
                             f"blocks of {head.config.block_size}")
        return depth


OBJECTIVE = DFlashObjective
