"""Training checkpoints without pickle: safetensors for tensors, JSON for everything else.

accelerate's ``save_state``/``load_state`` pickle registered objects and RNG states and unpickle them
with ``weights_only=False``, so a crafted checkpoint would run code on ``resume_from``. A checkpoint
directory here holds only:

| file                          | what                                                        |
|-------------------------------|-------------------------------------------------------------|
| ``model.safetensors``         | the head's weights                                           |
| ``backbone.safetensors``      | only in Medusa-2 runs: the LoRA adapters trained on the target |
| ``optimizer.safetensors``     | optimizer tensors; param groups and scalars as JSON metadata |
| ``scheduler.json``            | the LR scheduler's state dict                                |
| ``rng_state_<rank>.safetensors`` | torch/CUDA/numpy generators; Python's ``random`` as JSON metadata |
| ``head_config.json``          | the head's config (checked against the run on resume)       |
| ``COMPLETE``                  | written last: loop position (JSON) and size + sha256 of every file above |

Loading reads nothing but these names, and checks every file against ``COMPLETE`` before any state
changes, so a truncated or altered file is named instead of half-loaded.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn

from draftsmith.data.base.paths import file_digest, share_readable
from draftsmith.train.backbone import lora_parameters

CHECKPOINTS = "checkpoints"
BEST = "best"  # output_dir/best: the head with the best simulated τ so far
METRICS_FILE = "metrics.jsonl"  # output_dir/metrics.jsonl: one JSON record per log or eval step
RUN_MARKER = ".draftsmith-run"  # written first into a run's output_dir: the folder is ours to write and replace
COMPLETE = "COMPLETE"  # written last into a checkpoint directory
HEAD_CONFIG = "head_config.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
BACKBONE_FILE = "backbone.safetensors"
SCHEDULER_FILE = "scheduler.json"
FORMAT = "draftsmith-checkpoint"
FORMAT_VERSION = 2  # 1 was accelerate's save_state (pickles)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the directory and the file."""


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.safetensors"


def checkpoint_steps(output_dir: Path) -> list[Path]:
    """Checkpoint directories with a ``COMPLETE`` marker, newest (highest step) first."""
    done = [p for p in (Path(output_dir) / CHECKPOINTS).glob("step-*") if (p / COMPLETE).is_file()]
    return sorted(done, key=lambda p: int(p.name.removeprefix("step-")), reverse=True)


# ---------------------------------------------------------------- save


def save(path: Path, *, head: nn.Module, optimizer, scheduler, loop_state: dict, rank: int, is_main: bool,
         barrier, backbone: nn.Module | None = None) -> None:
    """Write one checkpoint to ``path`` (every process calls this; ``barrier`` = wait_for_everyone).

    Each process writes its own RNG state; the main process writes the rest and, after every process
    is done, ``COMPLETE`` with the manifest.
    """
    path.mkdir(parents=True, exist_ok=True)
    _save_rng(path / rng_file(rank))
    if is_main:
        save_model(head, str(path / MODEL_FILE))  # handles tied weights
        if backbone is not None:
            save_file({k: v.detach().cpu().contiguous() for k, v in lora_parameters(backbone).items()},
                      str(path / BACKBONE_FILE))
        _save_optimizer(optimizer.state_dict(), path / OPTIMIZER_FILE)
        (path / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict()))
        (path / HEAD_CONFIG).write_text(head.config.to_json_string())
    barrier()
    if is_main:
        share_readable(path)
        files = {p.name: file_digest(p) for p in sorted(path.iterdir()) if p.is_file() and p.name != COMPLETE}
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "state": loop_state, "files": files}
        tmp = path / f".{COMPLETE}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1))
        share_readable(tmp)
        tmp.replace(path / COMPLETE)  # atomic: a checkpoint is complete or it is not
    barrier()


def prune(output_dir: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (main process only)."""
    for old in checkpoint_steps(output_dir)[keep:]:
        shutil.rmtree(old)


def _save_optimizer(state: dict, path: Path) -> None:
    """``optimizer.state_dict()`` as safetensors: per-parameter tensors, the rest as JSON metadata."""
    tensors, scalars = {}, {}
    for index, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{name}"] = value
    metadata = {"param_groups": json.dumps(state["param_groups"]), "scalars": json.dumps(scalars)}
    save_file(tensors, str(path), metadata=metadata)


def _save_rng(path: Path) -> None:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, gauss = random.getstate()
    metadata = {"numpy": json.dumps([name, int(pos), int(has_gauss), float(cached)]),
                "python": json.dumps([version, list(internal), gauss])}
    save_file(tensors, str(path), metadata=metadata)


# ---------------------------------------------------------------- load


@dataclass
class Checkpoint:
    """A checkpoint read fully into memory and checked; nothing applied yet."""

    path: Path
    state: dict  # loop position
    head_config: dict
    model: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: tuple[dict[str, torch.Tensor], dict[str, str]]
    backbone: dict[str, torch.Tensor] | None = None  # Medusa-2's LoRA tensors


def read(path: Path, rank: int) -> Checkpoint:
    """Read and verify checkpoint ``path``; ``CheckpointError`` names the first bad file."""
    path = Path(path)
    marker = path / COMPLETE
    if not marker.is_file():
        raise CheckpointError(f"{path}: not a complete training checkpoint (no {COMPLETE} marker)")
    manifest = _json(marker)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: written by an earlier draftsmith as accelerate state, which holds pickles that could run "
            "code when loaded; it is not loaded. Start afresh (overwrite_output_dir=true) or resume from a "
            "checkpoint made by this version")
    files = manifest.get("files") or {}
    for name in (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, HEAD_CONFIG, rng_file(rank)):
        if name not in files:
            raise CheckpointError(f"{path / name}: missing from the checkpoint's {COMPLETE} manifest")
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (listed in {COMPLETE})")
        if file.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, {expected['bytes']} when saved "
                                  "(truncated or overwritten)")
        if file_digest(file)["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{file}: content changed since it was saved (sha256 mismatch)")
    optimizer, optimizer_meta = _tensors(path / OPTIMIZER_FILE)
    rng = _tensors(path / rng_file(rank))
    backbone = _tensors(path / BACKBONE_FILE)[0] if BACKBONE_FILE in files else None
    return Checkpoint(path, manifest["state"], _json(path / HEAD_CONFIG), _tensors(path / MODEL_FILE)[0],
                      _optimizer_state(optimizer, optimizer_meta, path / OPTIMIZER_FILE),
                      _json(path / SCHEDULER_FILE), rng, backbone)


def apply(checkpoint: Checkpoint, *, head: nn.Module, optimizer, scheduler, backbone: nn.Module | None = None) -> None:
    """Load a checkpoint read by ``read`` into the head (and trained backbone), optimizer, scheduler and RNGs."""
    file = checkpoint.path / MODEL_FILE
    missing, unexpected = load_model(head, str(file), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{file}: tensors missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    _apply_backbone(checkpoint, backbone)
    optimizer.load_state_dict(checkpoint.optimizer)
    scheduler.load_state_dict(checkpoint.scheduler)
    tensors, metadata = checkpoint.rng
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")),
                                       key=lambda k: int(k.split(".")[1]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
    name, pos, has_gauss, cached = json.loads(metadata["numpy"])
    np.random.set_state((name, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(internal), gauss))


def _apply_backbone(checkpoint: Checkpoint, backbone: nn.Module | None) -> None:
    """Copy the checkpoint's LoRA tensors into ``backbone``: both or neither, with the same names and shapes."""
    file = checkpoint.path / BACKBONE_FILE
    if (backbone is None) != (checkpoint.backbone is None):
        have = "has" if checkpoint.backbone is not None else "has no"
        run = "trains" if backbone is not None else "does not train"
        raise CheckpointError(f"{checkpoint.path}: the checkpoint {have} {BACKBONE_FILE} but this run {run} a "
                              "backbone (train.backbone_lora_rank must match the run that wrote it)")
    if backbone is None:
        return
    params = lora_parameters(backbone)
    saved = checkpoint.backbone
    if params.keys() != saved.keys() or any(params[k].shape != saved[k].shape for k in params):
        raise CheckpointError(f"{file}: LoRA tensors do not fit this run's adapters (another "
                              "train.backbone_lora_rank or target?)")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name])


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from err


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        return load_file(str(path)), metadata
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{path}: unreadable ({err})") from err


def _optimizer_state(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> dict:
    try:
        groups, scalars = json.loads(metadata["param_groups"]), json.loads(metadata["scalars"])
    except (KeyError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: no param groups in its metadata ({err})") from err
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *scalars.items()]:
        index, _, name = key.partition(".")
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": groups}
