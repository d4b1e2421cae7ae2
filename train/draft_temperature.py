"""The draft temperature per depth, fitted on held-out rows (docs/objectives.md, "One recipe for both temperatures").

At temperature T > 0 an EAGLE drafter samples each draft from q = softmax(z / (s_d T)) over its draft vocabulary
(z the head's logits at draft depth d) and the verifier keeps it with probability min(1, p / q): a draft survives
with probability sum_v min(p_v, q_v). A head trained on top-1 labels has logits sharper than the target's law
(s_d > 1 flattens them); a head trained on the law may be a little flat. Greedy drafts (argmax z) do not change.

``DraftTemperatureFit`` sums, over held-out positions and for every s in ``GRID``, that survival chance at T = 1
(the target's law p restricted to the draft vocabulary, the head's logits at each unrolled step as training
computes them), per depth; ``best`` is the s of the largest sum at each depth: what ``train.evaluation`` stores
in the head's config (``draft_temperature``) before its decode τ and its save, and what the drafter divides its
logits by at every sampled level (deeper levels than fitted use the last).
"""
from __future__ import annotations

import torch
from torch import Tensor

# 2^(i/8) for i = -8 .. 24: 0.5 to 8, each 9% above the one before
GRID = tuple(2 ** (i / 8) for i in range(-8, 25))


class DraftTemperatureFit:
    """Summed survival chance per (depth, s in ``GRID``) over the positions ``add`` saw."""

    def __init__(self, depth: int, device: torch.device) -> None:
        self.state = torch.zeros(depth, len(GRID) + 1, dtype=torch.float64, device=device)  # [..., -1]: count

    @torch.no_grad()
    def add(self, depth: int, logits: Tensor, probs: Tensor, mask: Tensor) -> None:
        """Positions ``mask`` (...) keeps of draft ``logits`` (..., V) against the target's law ``probs`` (..., V)
        at draft depth ``depth`` (0 = the first draft)."""
        z, p = logits.float()[mask], probs.float()[mask]  # (n, V)
        if z.numel() == 0:
            return
        for i, s in enumerate(GRID):
            self.state[depth, i] += torch.minimum((z / s).softmax(-1), p).sum(dtype=torch.float64)
        self.state[depth, -1] += z.shape[0]

    def best(self) -> list[float]:
        """The s with the largest summed survival chance at each depth (1.0 where no position was seen)."""
        counts = self.state[:, -1]
        picks = self.state[:, :-1].argmax(-1)
        return [float(GRID[i]) if n > 0 else 1.0 for i, n in zip(picks.tolist(), counts.tolist())]

    def rates(self, temperatures: list[float]) -> list[float]:
        """Mean survival chance at each depth with its temperature from ``temperatures`` (a value of ``GRID``)."""
        counts = self.state[:, -1].clamp(min=1)
        return [float(self.state[d, GRID.index(s)] / counts[d]) for d, s in enumerate(temperatures)]
