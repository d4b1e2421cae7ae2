"""DFlash: blocks ``[t_a, MASK, ...]`` at random anchors a, all blocks of a sequence in one head
forward over context K/V built once per sequence; block position k (1..B-1) learns the target's
next-token distribution at a+k-1 (its prediction of token a+k) by soft cross-entropy (``train.loss=lk``:
LK^alpha, -log of the expected acceptance rate, instead).

A block sees the context strictly before its anchor (the anchor token's own features are not known
at inference: it is the token just emitted), every position of its own block, and no other block
(SpecForge's ``create_dflash_block_mask``). Anchors are positions whose first label is a training
target (``loss_mask[a + 1] = 1``), drawn per step from ``perturb``'s seed so a resumed run draws the
same ones. Position k's loss is weighted ``train.loss_decay ** (k - 1)`` (SpecForge's decay
``exp(-(k-1)/gamma)`` with ``loss_decay = exp(-1/gamma)``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from infer.target import TargetOutput
from train.config import TrainConfig
from train.features import Features
from train.losses import LossOutput, decayed_sum, soft_loss
from train.objectives.base import Objective, no_grad_embeds
from train.objectives.eagle3 import Eagle3Features, Eagle3Objective

BLOCKS_PER_SEQUENCE = 64  # anchors drawn per sequence and step (SpecForge: up to 512 on GPUs)
EVAL_CHUNK = 32  # anchors per head forward at evaluation (every position is one): bounds (B, C, depth, V) logits


def draw_anchors(loss_mask: Tensor, count: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(anchors, keep), both (B, N): up to ``count`` distinct sorted anchors a per row, 1 <= a <= T-2
    with ``loss_mask[a + 1] = 1``; rows with fewer fill with 1 and ``keep = False``."""
    batch, seq_len = loss_mask.shape
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if seq_len >= 3:
        valid[:, 1: seq_len - 1] = loss_mask[:, 2:].bool()
    counts = valid.sum(1)
    n = max(1, min(count, int(counts.max())))
    scores = torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device)
    scores = scores.masked_fill(~valid, 2.0)
    picked = scores.argsort(dim=1)[:, :n]
    keep = torch.arange(n, device=loss_mask.device)[None] < counts[:, None]
    anchors = torch.where(keep, picked, torch.ones_like(picked))
    order = anchors.masked_fill(~keep, seq_len).argsort(dim=1)  # sorted, padding last
    return anchors.gather(1, order), keep.gather(1, order)


def block_mask(anchors: Tensor, seq_len: int, block_size: int, dtype: torch.dtype) -> Tensor:
    """Additive (B, 1, N·bs, T + N·bs) mask: block n sees context t < anchors[n] and its own block."""
    batch, n = anchors.shape
    device = anchors.device
    q_block = torch.arange(n * block_size, device=device) // block_size  # (Q,)
    context = torch.arange(seq_len, device=device)[None, None] < anchors.repeat_interleave(block_size, 1)[..., None]
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
    out = head(embeds, positions, context, block_mask(anchors, seq_len, bs, embeds.dtype))
    return out.view(batch, n, bs, -1)


def sequence_context(head: nn.Module, features: Features) -> list:
    batch, seq_len = features.input_ids.shape
    return head.context_kv(features.hidden, torch.arange(seq_len, device=features.hidden.device).expand(batch, -1))


@dataclasses.dataclass(kw_only=True)
class DFlashFeatures(Eagle3Features):
    mask_embed: Tensor  # (H_t,) the target's embedding of the head's mask token, fp32
    anchors: Tensor | None = None  # (B, N) block start positions drawn for this step (perturb)
    anchor_keep: Tensor | None = None  # (B, N) bool: which drawn anchors are real (rows differ in length)


class DFlashObjective(Objective):
    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__(head, cfg)
        self.loss = cfg.train.loss

    aux_layer_ids = staticmethod(Eagle3Objective.aux_layer_ids)

    @staticmethod
    @torch.no_grad()
    def from_states(target: nn.Module, batch: dict, states: TargetOutput, head: nn.Module,
                    need_top1: bool = False) -> Features:
        """EAGLE-3's (the aux layers' hidden states, the embeddings, the target's own next-token law)
        and the mask token's embedding, which fills every block position after the anchor."""
        features = Eagle3Objective.from_states(target, batch, states, head)
        mask_id = torch.tensor([head.config.mask_token_id], device=features.input_ids.device)
        fields = {f.name: getattr(features, f.name) for f in dataclasses.fields(features)}
        return DFlashFeatures(**fields, mask_embed=no_grad_embeds(target, mask_id)[0])

    def perturb(self, features: Features, cfg: TrainConfig, seed: int) -> None:
        """Draw this step's anchors (from ``seed``: a resumed run draws the same)."""
        generator = torch.Generator(features.loss_mask.device).manual_seed(seed)
        features.anchors, features.anchor_keep = draw_anchors(features.loss_mask, BLOCKS_PER_SEQUENCE, generator)

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features
        if f.anchors is None:  # called without perturb (e.g. directly): a fixed draw
            self.perturb(f, None, seed=0)
        bs = self.head.config.block_size
        seq_len = f.input_ids.shape[1]
        out = block_outputs(self.head, f, f.anchors, sequence_context(self.head, f))  # (B, N, bs, H)
        losses, correct, count = [], [], []
        for k in range(1, bs):
            label = f.anchors + k  # the token block position k drafts
            inside = label < seq_len
            safe = label.clamp(max=seq_len - 1)
            mask = f.anchor_keep & inside & f.loss_mask.gather(1, safe).bool()  # (B, N)
            probs = f.targets.probs.gather(1, (safe - 1)[..., None].expand(-1, -1, f.targets.probs.shape[-1]))
            logits = lm_head(out[:, :, k]).float()  # (B, N, V)
            value, n = soft_loss(logits, probs, mask, self.loss)
            losses.append(value)
            correct.append(((logits.argmax(-1) == f.top1.gather(1, safe - 1)) & mask).sum().float())
            count.append(n)
        return LossOutput(decayed_sum(losses, self.decay), torch.stack(losses).detach(), torch.stack(correct),
                          torch.stack(count))

    @staticmethod
    @torch.no_grad()
    def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
        """Position i's drafts: the block at anchor i+1 (context ``<= i``), positions 1..depth."""
        batch, seq_len = features.input_ids.shape
        drafted = torch.zeros(depth, batch, seq_len, dtype=torch.long, device=features.input_ids.device)
        context = sequence_context(head, features)
        for start in range(0, seq_len - 1, EVAL_CHUNK):
            positions = torch.arange(start, min(start + EVAL_CHUNK, seq_len - 1), device=drafted.device)
            anchors = (positions + 1)[None].expand(batch, -1)
            out = block_outputs(head, features, anchors, context)  # (B, C, bs, H)
            drafted[:, :, positions] = lm_head(out[:, :, 1: 1 + depth]).argmax(-1).permute(2, 0, 1)
        return drafted

    @staticmethod
    def eval_depth(head: nn.Module, cfg: TrainConfig) -> int:
        depth = cfg.train.eval_depth or head.config.block_size - 1
        if depth > head.config.block_size - 1:
            raise ValueError(f"train.eval_depth={depth} exceeds the DFlash head's block_size - 1 = "
                             f"{head.config.block_size - 1}")
        return depth


OBJECTIVE = DFlashObjective
