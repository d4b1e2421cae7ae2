"""EAGLE-3's drafter: EAGLE's draft loop over the head's fused aux features, drafting in the head's
own (maybe reduced) vocabulary and mapping draft ids back to target ids. A P-EAGLE head
(``head.variant=peagle``) gets ``infer.drafters.variants.peagle.PEagleDrafter``: all K drafts from one forward."""
from __future__ import annotations

import importlib

from torch import Tensor, nn

from draftsmith.infer.drafters.base import Chain
from draftsmith.infer.drafters.eagle import EagleDrafter


def _is_peagle(head: nn.Module) -> bool:
    return bool(getattr(head.config, "is_peagle", False))


class Eagle3Drafter(EagleDrafter):
    gpu_depth = 8

    def __new__(cls, head: nn.Module, *args, **kwargs):
        """The kind's one drafter class builds P-EAGLE's for a P-EAGLE head (its variant, not its kind), found by
        name as every kind's drafter is (``infer.drafters.drafter_class``; peagle.py builds on this module)."""
        if cls is Eagle3Drafter and _is_peagle(head):
            cls = importlib.import_module("draftsmith.infer.drafters.variants.peagle").DRAFTER
        return super().__new__(cls)

    @staticmethod
    def longest_chain(head: nn.Module) -> int:
        """P-EAGLE: the depths it was trained to draft (``num_depths``); EAGLE-3: 16."""
        return head.config.num_depths if _is_peagle(head) else 16

    @classmethod
    def fits(cls, head: nn.Module, tree) -> bool:
        if _is_peagle(head):  # chains only
            return isinstance(tree, Chain) and tree.length <= head.config.num_depths
        return super().fits(head, tree)

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.head.compute_logits(hidden).float()

    def _to_target(self, ids: Tensor) -> Tensor:
        return self.head.draft_to_target(ids)

    def _project(self, features: Tensor) -> Tensor:
        return self.head.project(features)


DRAFTER = Eagle3Drafter
