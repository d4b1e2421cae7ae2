"""Self-speculation by layer skip (training-free): the target's own first ``k`` decoder layers, its
final norm and its lm_head draft a chain, so no second model sits in memory.

``early_exit_view(target, k)`` is a view of the target that stops after layer ``k``: a shallow copy
whose module tree holds the target's own layer objects (nothing is copied or trained). A draft model
is anything ``LMDrafter`` drafts with, so ``LayerSkipDrafter`` is an ``LMDrafter`` over that view, with
its own KV cache of the first ``k`` layers. Verification stays the full target's, so decoding is as
lossless as with any drafter. ``k`` trades acceptance (more layers draft better) against cost (each
draft token costs k/L of a target forward on CPU): ``scripts/calibrate_layer_skip.py`` measures every
``k`` on held-out prompts and writes the fastest to a calibration file in the cache
(``calibration_path``: keyed by the target's identity, device type and dtype), where
``LayerSkipDrafter(target)`` (``k=None``) finds it; without one, ``default_layers``.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from torch import nn

from data.base.checks import count
from data.base.paths import cache_root
from infer.drafters import Chain
from infer.lm_drafter import LMDrafter
from infer.target import backbone_of, causal_lm_of, decoder_layers, loaded_target_identity

CALIBRATION_DIR = "layer-skip"  # under the cache root: one JSON per (target, device type, dtype)


def default_layers(target: nn.Module) -> int:
    """Half the target's layers (rounded up): where LayerSkip-style self-speculation usually starts;
    measure others with ``scripts/benchmark.py --layer-skip``."""
    return (len(decoder_layers(target)) + 1) // 2


def calibration_key(target: nn.Module) -> dict:
    """What a layer-skip calibration depends on: the target's identity, its device type and dtype."""
    weight = target.get_output_embeddings().weight
    return {**loaded_target_identity(target), "device": weight.device.type, "dtype": str(weight.dtype)}


def calibration_path(target: nn.Module) -> Path:
    """``<cache>/layer-skip/<model name>-<hash of calibration_key>.json``."""
    key = calibration_key(target)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(key["name_or_path"] or "target").name)
    return cache_root() / CALIBRATION_DIR / f"{name}-{digest}.json"


def calibrated_layers(target: nn.Module) -> int | None:
    """The ``k`` a calibration chose for this target, device and dtype; None when none was run."""
    path = calibration_path(target)
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    k = record.get("best_layers") if isinstance(record, dict) else None
    if not isinstance(k, int) or not 1 <= k < len(decoder_layers(target)):
        raise ValueError(f"{path}: best_layers={k!r} is not a layer count of this {len(decoder_layers(target))}-layer "
                         "target; run scripts/calibrate_layer_skip.py again (it rewrites the file)")
    return k


def early_exit_view(target: nn.Module, k: int) -> nn.Module:
    """The target stopped after its first ``k`` decoder layers (then its final norm and lm_head).

    The view shares every parameter with ``target`` (a change to one is a change to both) and has its
    own config saying ``num_hidden_layers=k`` (and the first ``k`` ``layer_types``)."""
    model = causal_lm_of(target)
    stack = _first_layers(target, k)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, model.base_model_prefix, stack)
    view.config = stack.config
    return view


def shallow_backbone(target: nn.Module, k: int) -> nn.Module:
    """The target's decoder stack stopped after its first ``k`` layers, without the final norm: its
    ``last_hidden_state`` is HF ``hidden_states[k]`` of the full target (what an early-exit head reads)."""
    stack = _first_layers(target, k)
    stack.norm = nn.Identity()
    return stack


def _first_layers(target: nn.Module, k: int) -> nn.Module:
    """A shallow copy of the target's backbone over its first ``k`` layers (its own module table and
    config; the layer objects are the target's)."""
    layers = decoder_layers(target)
    count("layer-skip layers", k)
    if k >= len(layers):
        raise ValueError(f"layer skip drafts with fewer than the target's {len(layers)} layers; got k={k}")
    backbone = backbone_of(target)
    config = copy.deepcopy(causal_lm_of(target).config)
    config.num_hidden_layers = k
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:k]
    stack = copy.copy(backbone)
    stack._modules = dict(backbone._modules)  # its own module table: the target's keeps all layers
    stack.layers = nn.ModuleList(list(layers)[:k])
    stack.config = config
    return stack


class LayerSkipDrafter(LMDrafter):
    """Draft a chain with the target's first ``k`` layers (``k=None``: the calibrated ``k``, else
    ``default_layers``; ``calibrated`` says which)."""

    def __init__(self, target: nn.Module, k: int | None = None, tree: Chain | None = None,
                 confidence: float | None = None) -> None:
        found = calibrated_layers(target) if k is None else None
        self.calibrated = found is not None
        self.layers = k if k is not None else found or default_layers(target)
        super().__init__(early_exit_view(target, self.layers), target, tree, confidence)
