"""Where a run stands: ``TrainState`` (the loop position saved with every checkpoint), saving a
checkpoint, and resuming from one (``resume_from``).

What a resume takes from the checkpoint: the head's weights and config (head.*, and the target it was
built for: ``check_resumable``), the optimizer state with its hyper-parameters, the scheduler
state, the RNG states and the loop position (step, epoch, micro-batch). The settings that this state
fixes are ``RESUME_FIXED``, recorded in every checkpoint; a resume whose config changes one of them
is refused, naming the keys and both values (continuing would silently keep the checkpoint's value
while config.yaml recorded the new one). Everything else is taken from the new config, and applied:
train.max_steps / epochs / max_minutes, the schedule's shape (warmup_steps, decay), max_grad_norm,
loss_decay, feature_noise, mixed_precision, evaluation, saving and logging.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate import Accelerator
from torch import nn

from draftsmith.data.base.checks import count
from draftsmith.train import checkpoint
from draftsmith.train.checkpoint import CHECKPOINTS
from draftsmith.train.config import ConfigError, TrainConfig

logger = logging.getLogger("draftsmith.train")

# Settings a checkpoint fixes: the optimizer's hyper-parameters (restored with its state) and what
# the saved data position means (data order, batch shapes); head.* is checked by check_resumable.
RESUME_FIXED = ("seed", "data.train", "data.max_length", "data.overlong", "data.self_distill", "train.micro_batch_size",
                "train.grad_accum_steps", "train.lr", "train.betas", "train.weight_decay",
                "train.backbone_lora_rank", "train.backbone_lr", "train.stage")


class RunComplete(Exception):
    """``resume_from=latest`` on a run that already finished: nothing to train, evaluate or save."""


def resume_settings(cfg: TrainConfig | dict) -> dict:
    """The ``RESUME_FIXED`` values of ``cfg`` (a config or its ``to_dict()``), JSON-plain."""
    tree = cfg if isinstance(cfg, dict) else cfg.to_dict()
    values = {}
    for key in RESUME_FIXED:
        node = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        values[key] = node
    return json.loads(json.dumps(values))


def check_settings(saved: dict | None, cfg: TrainConfig, checkpoint_path: Path, output_dir: Path) -> None:
    """Refuse (ConfigError) a resume whose config changes a setting the checkpoint fixes.

    ``saved`` is the checkpoint's record; checkpoints from before it are compared with the
    config.yaml of ``output_dir`` (the run that wrote them), when there is one.
    """
    if not saved:
        recorded = output_dir / "config.yaml"
        if not recorded.is_file():
            logger.warning("%s records no settings and %s is missing: cannot check that %s are unchanged",
                           checkpoint_path, recorded, ", ".join(RESUME_FIXED))
            return
        import yaml

        saved = resume_settings(yaml.safe_load(recorded.read_text()) or {})
    now = resume_settings(cfg)
    changed = [f"{key}={saved.get(key)!r} in the checkpoint, {now[key]!r} now"
               for key in RESUME_FIXED if key in saved and saved[key] != now[key]]
    if changed:
        raise ConfigError(f"resume_from={cfg.resume_from}: {checkpoint_path} was trained with other settings than "
                          f"this config ({'; '.join(changed)}); a resume keeps the checkpoint's: drop the change "
                          "to continue, or start fresh with overwrite_output_dir=true (or another output_dir)")


def check_not_complete(cfg: TrainConfig, output_dir: Path) -> None:
    """``RunComplete`` when ``resume_from=latest`` names a run that finished (``mark_complete``) at
    the steps this config asks for."""
    if cfg.resume_from != "latest":
        return
    try:
        record = json.loads((output_dir / checkpoint.RUN_MARKER).read_text())
    except (OSError, ValueError):
        return
    done = record.get("complete") if isinstance(record, dict) else None
    if not isinstance(done, dict) or not isinstance(done.get("step"), int):
        return
    if cfg.train.max_steps is not None:
        complete = done["step"] >= cfg.train.max_steps
    else:
        complete = done.get("train.max_steps") is None and done.get("train.epochs") == cfg.train.epochs
    if complete:
        raise RunComplete(f"output_dir={output_dir}: the run is complete (step {done['step']}, head saved in "
                          f"{output_dir}); nothing to resume. To train further raise train.max_steps, or start "
                          "fresh with overwrite_output_dir=true")


def mark_run(output_dir: Path, *, complete: dict | None = None) -> None:
    """Write ``RUN_MARKER`` (first, into a new run's folder; again when the run completes)."""
    record = {"written_by": "draftsmith train: overwrite_output_dir=true may replace this folder"}
    if complete is not None:
        record["complete"] = complete
    (output_dir / checkpoint.RUN_MARKER).write_text(json.dumps(record, indent=1) + "\n")


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
    settings: dict = field(default_factory=dict)  # resume_settings(cfg) of the run: what a resume must not change

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, if any (not checked for corruption: see ``resume``)."""
    return next(iter(checkpoint.checkpoint_steps(output_dir)), None)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, state: TrainState, head: nn.Module, optimizer,
                    scheduler, keep: int, backbone: nn.Module | None = None) -> Path:
    """Full training state (head, trained backbone adapters, optimizer, scheduler, RNG, loop position) of
    step ``state.step``; no pickle."""
    path = output_dir / CHECKPOINTS / f"step-{state.step:07d}"
    checkpoint.save(path, head=head, backbone=backbone, optimizer=optimizer, scheduler=scheduler,
                    loop_state=state.state_dict(),
                    rank=accelerator.process_index, is_main=accelerator.is_main_process,
                    barrier=accelerator.wait_for_everyone)
    if accelerator.is_main_process:
        checkpoint.prune(output_dir, keep)
    accelerator.wait_for_everyone()
    return path


def resume(accelerator: Accelerator, cfg: TrainConfig, output_dir: Path, head: nn.Module, optimizer, scheduler,
           state: TrainState, backbone: nn.Module | None = None) -> Path:
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
        check_settings(loaded.state.get("settings"), cfg, path, output_dir)
        for name in ("step", "epoch", "batch"):  # the loop position indexes the data: whole numbers >= 0
            count(f"{path}: {name}", loaded.state.get(name), least=0)
        checkpoint.apply(loaded, head=head, backbone=backbone, optimizer=optimizer, scheduler=scheduler)
        if loaded.head_config.get("draft_temperature") is not None:  # the last evaluation's fit, as it was saved
            head.config.draft_temperature = loaded.head_config["draft_temperature"]
        state.load_state_dict(loaded.state)
        return path
    raise AssertionError("unreachable")


def check_resumable(loaded: checkpoint.Checkpoint, head: nn.Module) -> None:
    """Fail loudly when a checkpoint was made for another head or target."""
    saved = loaded.head_config
    current = json.loads(head.config.to_json_string())
    # set by saving; the draft temperature is fitted at each evaluation and comes back with the checkpoint
    ignore = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "draft_temperature"}
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
            for k in sorted((set(saved) | set(current)) - ignore) if saved.get(k) != current.get(k)]
    if diff:
        raise ValueError(f"checkpoint {loaded.path} does not match this run's head/target:\n  " + "\n  ".join(diff))
