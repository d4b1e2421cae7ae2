"""The MTP head's drafter: EAGLE-1's draft loop (``infer.drafters.eagle``) over the target's own MTP block.

The block reads the target's final post-norm state at the last accepted token and the root's embedding, and
its post-norm output goes both to the target's lm_head (the draft's law) and back into the block for the
next level: a chain of k drafts reuses the layer k times, as vLLM's ``spec_step_idx % num_mtp_layers`` does
for a one-layer block; an EAGLE-2 dynamic tree expands it level by level the same way.
"""
from __future__ import annotations

from torch import nn

from draftsmith.infer.drafters.eagle import EagleDrafter


class MtpDrafter(EagleDrafter):
    gpu_depth = 6

    def __init__(self, head: nn.Module, target: nn.Module, tree, confidence: float | None = None) -> None:
        layers = head.config.num_mtp_layers or 1
        if layers > 1:
            raise ValueError(f"an MTP head of {layers} layers: drafting uses one layer per level only for a one-layer "
                             "block so far (DeepSeek-V3, Qwen3-Next and Qwen3.5 ship one)")
        super().__init__(head, target, tree, confidence)


DRAFTER = MtpDrafter
