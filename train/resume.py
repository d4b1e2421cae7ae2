"""Where a run stands: ``TrainState`` (the loop position saved with every checkpoint), saving a
checkpoint, and resuming from one (``resume_from``)."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate import Accelerator
from torch import nn

from train import checkpoint
from train.checkpoint import CHECKPOINTS
from train.config import TrainConfig

logger = logging.getLogger("draftsmith.train")


@dataclass
class TrainState:
    """Loop position saved (as JSON) with every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position of the next micro-batch: epoch ...
    batch: int = 0  # ... and micro-batch index within it (per process)
    tokens: int = 0  # non-pad tokens trained on, all processes
    best_tau: float = -math.inf
    best_step: int = -1
    guard: dict = field(default_factory=dict)  # DivergenceGuard.state_dict()

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, if any (not checked for corruption: see ``resume``)."""
    return next(iter(checkpoint.checkpoint_steps(output_dir)), None)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, state: TrainState, head: nn.Module, optimizer,
                    scheduler, keep: int) -> Path:
    """Full training state (head, optimizer, scheduler, RNG, loop position) of step ``state.step``; no pickle."""
    path = output_dir / CHECKPOINTS / f"step-{state.step:07d}"
    checkpoint.save(path, head=head, optimizer=optimizer, scheduler=scheduler, loop_state=state.state_dict(),
                    rank=accelerator.process_index, is_main=accelerator.is_main_process,
                    barrier=accelerator.wait_for_everyone)
    if accelerator.is_main_process:
        checkpoint.prune(output_dir, keep)
    accelerator.wait_for_everyone()
    return path


def resume(accelerator: Accelerator, cfg: TrainConfig, output_dir: Path, head: nn.Module, optimizer, scheduler,
           state: TrainState) -> Path:
    """Load ``cfg.resume_from`` into head, optimizer, scheduler, RNGs and ``state``; return its path.

    ``latest`` takes the newest checkpoint that reads back intact; a corrupt one is named in a warning
    and the next older one is tried. An explicit path is loaded or refused, never replaced.
    """
    if cfg.resume_from == "latest":
        candidates = checkpoint.checkpoint_steps(output_dir)
        if not candidates:
            raise FileNotFoundError(f"resume_from=latest: no complete checkpoint in {output_dir / CHECKPOINTS}")
    else:
        candidates = [Path(cfg.resume_from)]
    for number, path in enumerate(candidates):
        try:
            loaded = checkpoint.read(path, accelerator.process_index)
        except checkpoint.CheckpointError as err:
            if cfg.resume_from != "latest" or number == len(candidates) - 1:
                raise
            logger.warning("cannot resume from %s: %s; falling back to %s", path, err, candidates[number + 1])
            continue
        check_resumable(loaded, head)
        checkpoint.apply(loaded, head=head, optimizer=optimizer, scheduler=scheduler)
        state.load_state_dict(loaded.state)
        return path
    raise AssertionError("unreachable")


def check_resumable(loaded: checkpoint.Checkpoint, head: nn.Module) -> None:
    """Fail loudly when a checkpoint was made for another head or target."""
    saved = loaded.head_config
    current = json.loads(head.config.to_json_string())
    ignore = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"}  # set by saving
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
            for k in sorted((set(saved) | set(current)) - ignore) if saved.get(k) != current.get(k)]
    if diff:
        raise ValueError(f"checkpoint {loaded.path} does not match this run's head/target:\n  " + "\n  ".join(diff))
