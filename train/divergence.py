"""Divergence detection: the training loop asks once per optimizer step whether to stop.

A run whose learning rate is far too high can sit at a constant loss or climb to 1e9 while every
number stays finite; these rules stop it before its checkpoint is written, for every head kind.
"""
from __future__ import annotations

import math


class TrainingDiverged(FloatingPointError):
    """Training stopped at a step whose loss, gradient norm or update diverged; nothing was saved for it."""


class DivergenceGuard:
    """Decides, once per optimizer step, whether training has diverged.

    Before the update: a non-finite loss or gradient norm, a loss above ``LOSS_FACTOR`` x the first
    step's loss (a fresh head starts near its worst), or a gradient norm above ``GRAD_FACTOR`` x the
    median of the last ``WINDOW`` steps. After the update: the weights' norm changing by more than
    ``UPDATE_FACTOR`` of itself in one step (a learning rate far too high: the update, not the data,
    is what explodes, and the checkpoint of this step must not be written). Its state travels in
    checkpoints (JSON) so a resumed run judges by the same reference.
    """

    LOSS_FACTOR = 10.0
    GRAD_FACTOR = 1000.0
    UPDATE_FACTOR = 1.0
    WINDOW = 50

    def __init__(self, check_grad: bool = True) -> None:
        self.check_grad = check_grad  # fp16: the grad scaler skips inf steps itself
        self.first_loss: float | None = None
        self.grad_norms: list[float] = []

    def check_step(self, step: int, loss: float, grad_norm: float) -> str | None:
        """Why step ``step`` diverged before its update, or None (then the values are recorded)."""
        if not math.isfinite(loss) or (self.check_grad and not math.isfinite(grad_norm)):
            return f"loss {loss} / grad norm {grad_norm} at step {step} is not finite"
        if self.first_loss is not None and self.first_loss > 0 and loss > self.LOSS_FACTOR * self.first_loss:
            return (f"loss {loss:.4g} at step {step} exceeds {self.LOSS_FACTOR:g}x the first step's loss "
                    f"{self.first_loss:.4g}")
        if self.check_grad and len(self.grad_norms) >= 3:
            median = sorted(self.grad_norms)[len(self.grad_norms) // 2]
            if median > 0 and grad_norm > self.GRAD_FACTOR * median:
                return (f"grad norm {grad_norm:.4g} at step {step} exceeds {self.GRAD_FACTOR:g}x the median "
                        f"{median:.4g} of the last {len(self.grad_norms)} steps")
        if self.first_loss is None:
            self.first_loss = loss
        if math.isfinite(grad_norm):
            self.grad_norms = (self.grad_norms + [grad_norm])[-self.WINDOW:]
        return None

    def check_update(self, step: int, norm_before: float, norm_after: float) -> str | None:
        """Why the update of step ``step`` diverged (weight norms before and after it), or None."""
        if not math.isfinite(norm_after):
            return f"the weights are not finite after the update at step {step}"
        if norm_before > 0 and abs(norm_after - norm_before) > self.UPDATE_FACTOR * norm_before:
            return (f"the update at step {step} changed the weight norm from {norm_before:.4g} to {norm_after:.4g} "
                    "(the learning rate is far too high)")
        return None

    def state_dict(self) -> dict:
        return {"first_loss": self.first_loss, "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.first_loss, self.grad_norms = state.get("first_loss"), list(state.get("grad_norms") or [])
