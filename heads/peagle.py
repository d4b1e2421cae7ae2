"""P-EAGLE's two learned inputs on the EAGLE-3 head (``head.variant=peagle``; arXiv 2602.01469, docs/objectives.md,
"P-EAGLE").

P-EAGLE drafts K tokens in one forward of the EAGLE-3 layer: after the accepted tokens (their target features
and next tokens, as EAGLE-3 reads them) come K-1 *mask* positions, each reading

- ``mask_hidden``: a learned stand-in for the target's fused aux features, (1, 1, n·H_t), fused by ``fc`` as real
  features are (the speculators library's ``PEagleDraftModel.mask_hidden``; vLLM's ``mask_hidden`` projected by
  ``combine_hidden_states``), shared by every mask position;
- ``mask_embedding``: a learned input embedding, (H,), in place of the target's embedding of a token. The
  speculators layout has no tensor of its own for it: it trains the whole embedding table and vLLM embeds the
  mask positions as token ``mask_token_id`` (``pard_token``) through the draft's own ``embed_tokens``; our export
  writes the target's table with row ``mask_token_id`` replaced by this vector (``heads.formats.peagle``).

The output at the last accepted position drafts token 1 (as EAGLE-3's first step); the output at mask
position d (1..K-1), at RoPE position last + d, drafts token d+1. Mask positions attend causally: the accepted
context, then the masks before them. No draft feeds another (greedy and sampling draw each position from its
own law).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

PEAGLE_ARCHITECTURE = "PEagleSpeculator"  # the speculators library's architectures entry for peagle
DEFAULT_DEPTHS = 8  # speculators' num_depths default (its trainer's and proposal's speculative_tokens)
# COD sampling (speculators' generate_cod_sample_indices defaults): depth d keeps about max(r^d, r_min) of the
# valid anchors, drawn among the anchors that reached depth d-1
COD_RATIO, COD_RATIO_MIN = 0.7, 0.2


def init_parallel_inputs(head: nn.Module, target_width: int, aux_layers: int) -> None:
    """Register ``mask_hidden`` (1, 1, aux_layers·target_width), N(0, 1) as speculators starts it, and
    ``mask_embedding`` (H,), N(0, initializer_range), on ``head`` (training starts the latter at the target's
    embedding of ``mask_token_id``: ``train.objectives.peagle``)."""
    cfg = head.config
    head.mask_hidden = nn.Parameter(torch.randn(1, 1, aux_layers * target_width))
    head.mask_embedding = nn.Parameter(torch.randn(cfg.hidden_size) * cfg.initializer_range)


def mask_inputs(head: nn.Module, rows: int, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hidden (rows, n, H), embeds (rows, n, H)): what ``n`` mask positions read, ``mask_hidden`` fused by the
    head's ``project`` (fc) and the mask embedding."""
    hidden = head.project(head.mask_hidden.to(dtype)).expand(rows, n, -1)
    embeds = head.mask_embedding.to(dtype)[None, None].expand(rows, n, -1)
    return hidden, embeds
