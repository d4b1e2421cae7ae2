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
  writes the target's table with row ``mask_token_id`` replaced by this vector (``heads.formats.variants.peagle``).

The output at the last accepted position drafts token 1 (as EAGLE-3's first step); the output at mask
position d (1..K-1), at RoPE position last + d, drafts token d+1. Mask positions attend causally: the accepted
context, then the masks before them. No draft feeds another (greedy and sampling draw each position from its
own law).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.heads.eagle3 import Eagle3Config, Eagle3Head

PEAGLE_ARCHITECTURE = "PEagleSpeculator"  # the speculators library's architectures entry for peagle
DEFAULT_DEPTHS = 8  # speculators' num_depths default (its trainer's and proposal's speculative_tokens)
# COD sampling (speculators' generate_cod_sample_indices defaults): depth d keeps about max(r^d, r_min) of the
# valid anchors, drawn among the anchors that reached depth d-1
COD_RATIO, COD_RATIO_MIN = 0.7, 0.2


def init_parallel_inputs(head: nn.Module, target_width: int, aux_layers: int) -> None:
    """Register ``mask_hidden`` (1, 1, aux_layers·target_width), N(0, 1) as speculators starts it, and
    ``mask_embedding`` (H,), N(0, initializer_range), on ``head`` (training starts the latter at the target's
    embedding of ``mask_token_id``: ``train.objectives.variants.peagle``)."""
    cfg = head.config
    head.mask_hidden = nn.Parameter(torch.randn(1, 1, aux_layers * target_width))
    head.mask_embedding = nn.Parameter(torch.randn(cfg.hidden_size) * cfg.initializer_range)


def mask_inputs(head: nn.Module, rows: int, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(hidden (rows, n, H), embeds (rows, n, H)): what ``n`` mask positions read, ``mask_hidden`` fused by the
    head's ``project`` (fc) and the mask embedding."""
    hidden = head.project(head.mask_hidden.to(dtype)).expand(rows, n, -1)
    embeds = head.mask_embedding.to(dtype)[None, None].expand(rows, n, -1)
    return hidden, embeds


class PEagleConfig(Eagle3Config):
    """P-EAGLE's config: EAGLE-3's fields, ``variant="peagle"``, and

    Args:
        mask_token_id: the token id the speculators layout and vLLM embed at mask positions (``pard_token``);
            None = ``vocab_size - 1``.
        num_depths: drafts per forward K (mask positions K-1), trained and drafted; None = 8.
    """

    variant = "peagle"
    # EAGLE-3.1's flags: vLLM's update_peagle passes neither on, so its P-EAGLE model would draft without them
    refused_options = ("fc_norm", "norm_output")

    def __init__(self, **kwargs):  # its own: transformers makes a config class without one a dataclass
        super().__init__(**kwargs)

    @property
    def is_peagle(self) -> bool:
        return True

    def _set_variant(self, variant: str | None, mask_token_id: int | None, num_depths: int | None,
                     eagle31: bool) -> None:
        super()._set_variant(variant, None, None, False)
        if eagle31:
            raise ValueError("variant=peagle takes neither fc_norm nor norm_output (vLLM's P-EAGLE reader drops both): "
                             "set both false (configs/demo.yaml sets norm_output true)")
        self.mask_token_id = self.vocab_size - 1 if mask_token_id is None else int(mask_token_id)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        self.num_depths = DEFAULT_DEPTHS if num_depths is None else int(num_depths)
        if self.num_depths < 1:
            raise ValueError(f"num_depths={self.num_depths} must be at least 1 (P-EAGLE's drafts per forward)")


class PEagleHead(Eagle3Head):
    """The EAGLE-3 head with P-EAGLE's two learned inputs (``init_parallel_inputs``)."""

    config_class = PEagleConfig
    title = "P-EAGLE"

    def _variant_input_lines(self) -> list[str]:
        cfg = self.config
        return [f"- P-EAGLE: {cfg.num_depths} drafts from one forward, the last {cfg.num_depths - 1} at mask positions "
                f"reading a learned shared hidden state and mask embedding (exported as token {cfg.mask_token_id})"]

    def _add_variant_modules(self, target_width: int) -> None:
        init_parallel_inputs(self, target_width, len(self.config.aux_layer_ids))
