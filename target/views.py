"""Views of the frozen target that share its parameters: its first ``k`` decoder layers (a drafter's model, an
early-exit head's trunk) and its layers from ``k`` on. Each is a shallow copy whose module table holds the target's own
layer objects and whose config says its own layer count (nothing is copied or trained)."""
from __future__ import annotations

import copy

from torch import nn

from draftsmith.data.base.checks import count
from draftsmith.heads.common import final_norm_name
from draftsmith.target.model import backbone_of, causal_lm_of, decoder_layers


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
    setattr(stack, final_norm_name(stack) or "norm", nn.Identity())
    return stack


def late_view(target: nn.Module, k: int) -> nn.Module:
    """The target from its layer ``k`` on: a view like ``early_exit_view`` whose backbone runs layers
    ``k``.. (each keeps its own layer index, so it reads and writes its own layer of a cache) on
    ``inputs_embeds`` = the residual stream entering layer ``k``, then the final norm and lm_head."""
    model = causal_lm_of(target)
    view = copy.copy(model)
    view._modules = dict(model._modules)
    stack = _layers(target, k, len(decoder_layers(target)))
    setattr(view, model.base_model_prefix, stack)
    view.config = stack.config
    return view


def _first_layers(target: nn.Module, k: int) -> nn.Module:
    """A shallow copy of the target's backbone over its first ``k`` layers (its own module table and
    config; the layer objects are the target's)."""
    count("layer-skip layers", k)
    if k >= len(decoder_layers(target)):
        raise ValueError(f"layer skip drafts with fewer than the target's {len(decoder_layers(target))} layers; got k={k}")
    return _layers(target, 0, k)


# config fields with one entry per layer that a backbone's forward reads by its layers' positions
PER_LAYER = ("layer_types", "layers_block_type")


def _layers(target: nn.Module, start: int, stop: int) -> nn.Module:
    """A shallow copy of the target's backbone over its layers [start, stop) (its own module table and
    config saying ``num_hidden_layers = stop - start``; the layer objects are the target's)."""
    backbone = backbone_of(target)
    config = copy.deepcopy(causal_lm_of(target).config)
    # per-layer lists, read before the count changes (some configs derive them from it)
    lists = {name: list(getattr(config, name)) for name in PER_LAYER if isinstance(getattr(config, name, None), list)}
    config.num_hidden_layers = stop - start
    derived = {}
    for name, values in lists.items():
        try:
            setattr(config, name, values[start:stop])
        except AttributeError:  # Jamba, Bamba, Falcon-H1: a read-only property of other fields
            derived[getattr(config, "attribute_map", {}).get(name, name)] = values[start:stop]
    if derived:  # this copy's own subclass holds the cut lists in place of the properties
        config.__class__ = type(type(config).__name__, (type(config),), derived)
    stack = copy.copy(backbone)
    stack._modules = dict(backbone._modules)  # its own module table: the target's keeps all layers
    stack.layers = nn.ModuleList(list(decoder_layers(target))[start:stop])
    stack.config = config
    return stack
