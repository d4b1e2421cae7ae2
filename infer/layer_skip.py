"""Self-speculation by layer skip (training-free): the target's own first ``k`` decoder layers, its
final norm and its lm_head draft a chain, so no second model sits in memory.

``early_exit_view(target, k)`` is a view of the target that stops after layer ``k``: a shallow copy
whose module tree holds the target's own layer objects (nothing is copied or trained). A draft model
is anything ``LMDrafter`` drafts with, so ``LayerSkipDrafter`` is an ``LMDrafter`` over that view, with
its own KV cache of the first ``k`` layers. Verification stays the full target's, so decoding is as
lossless as with any drafter. ``k`` trades acceptance (more layers draft better) against cost (each
draft token costs k/L of a target forward on CPU); ``scripts/benchmark.py --layer-skip K,K`` measures it.
"""
from __future__ import annotations

import copy

from torch import nn

from data.base.checks import count
from infer.drafters import Chain
from infer.lm_drafter import LMDrafter
from infer.target import backbone_of, causal_lm_of, decoder_layers


def default_layers(target: nn.Module) -> int:
    """Half the target's layers (rounded up): where LayerSkip-style self-speculation usually starts;
    measure others with ``scripts/benchmark.py --layer-skip``."""
    return (len(decoder_layers(target)) + 1) // 2


def early_exit_view(target: nn.Module, k: int) -> nn.Module:
    """The target stopped after its first ``k`` decoder layers (then its final norm and lm_head).

    The view shares every parameter with ``target`` (a change to one is a change to both) and has its
    own config saying ``num_hidden_layers=k`` (and the first ``k`` ``layer_types``)."""
    layers = decoder_layers(target)
    count("layer-skip layers", k)
    if k >= len(layers):
        raise ValueError(f"layer skip drafts with fewer than the target's {len(layers)} layers; got k={k}")
    model = causal_lm_of(target)
    backbone = backbone_of(target)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = k
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:k]
    stack = copy.copy(backbone)
    stack._modules = dict(backbone._modules)  # its own module table: the target's keeps all layers
    stack.layers = nn.ModuleList(list(layers)[:k])
    stack.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    setattr(view, model.base_model_prefix, stack)
    view.config = config
    return view


class LayerSkipDrafter(LMDrafter):
    """Draft a chain with the target's first ``k`` layers (``k=None``: ``default_layers``)."""

    def __init__(self, target: nn.Module, k: int | None = None, tree: Chain | None = None,
                 confidence: float | None = None) -> None:
        self.layers = default_layers(target) if k is None else k
        super().__init__(early_exit_view(target, self.layers), target, tree, confidence)
