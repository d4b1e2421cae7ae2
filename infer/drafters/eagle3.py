"""EAGLE-3's drafter: EAGLE's draft loop over the head's fused aux features, drafting in the head's
own (maybe reduced) vocabulary and mapping draft ids back to target ids. A P-EAGLE head
(``head.variant=peagle``) gets ``infer.drafters.variants.peagle.PEagleDrafter`` (``drafter_class``): all K drafts
from one forward."""
from __future__ import annotations

from torch import Tensor

from draftsmith.infer.drafters.eagle import EagleDrafter


class Eagle3Drafter(EagleDrafter):
    gpu_depth = 8

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.head.compute_logits(hidden).float()

    def _to_target(self, ids: Tensor) -> Tensor:
        return self.head.draft_to_target(ids)

    def _project(self, features: Tensor) -> Tensor:
        return self.head.project(features)


DRAFTER = Eagle3Drafter
