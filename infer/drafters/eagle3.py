"""EAGLE-3's drafter: EAGLE's draft loop over the head's fused aux features, drafting in the head's
own (maybe reduced) vocabulary and mapping draft ids back to target ids. A P-EAGLE head
(``head.variant=peagle``) gets ``infer.drafters.variants.peagle.PEagleDrafter`` (``drafter_class``): all K drafts
from one forward. Eager steps run the head without its module machinery where it can
(``infer.drafters.shared.lean_eagle3``: the same ops, checked bit for bit once per head)."""
from __future__ import annotations

from torch import Tensor

from draftsmith.infer.drafters.eagle import EagleDrafter
from draftsmith.infer.drafters.shared.lean_eagle3 import lean_eagle3


class Eagle3Drafter(EagleDrafter):
    gpu_depth = 8
    _lean = None  # set by begin: the head's lean step, or None (its modules)

    def begin(self, sampling, rows: int = 1) -> None:
        super().begin(sampling, rows)
        self._lean = lean_eagle3(self.head)

    def _step(self, cache, hidden: Tensor, tokens: Tensor, position: Tensor, mask: Tensor | None) -> Tensor:
        if self._lean is None:
            return super()._step(cache, hidden, tokens, position, mask)
        return self._lean(hidden, self.embed(tokens), position, mask, cache)

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.head.compute_logits(hidden).float()

    def _to_target(self, ids: Tensor) -> Tensor:
        return self.head.draft_to_target(ids)

    def _project(self, features: Tensor) -> Tensor:
        return self.head.project(features)


DRAFTER = Eagle3Drafter
