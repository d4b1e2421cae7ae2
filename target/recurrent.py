"""Recurrent and convolution states of hybrid targets, and how speculative decoding rolls them back.

Hybrid models (Qwen3.5/3.6 and Qwen3-Next's Gated DeltaNet, Nemotron-H / Granite-4-H / Falcon-H1 / Bamba
Mamba-2, Jamba's Mamba-1, LFM2's short convolution, Kimi-Linear, ...) keep, beside attention KV, a
fixed-size state per layer that every token updates: a causal-conv window and a recurrent (SSM or
delta-rule) matrix. A KV cache is rolled back by forgetting slots; these states cannot be: after a verify
over N drafted tokens accepts A < N of them, each layer's state must be the state after exactly the A
accepted tokens, and transformers' kernels return only the state after the last token of a forward.

draftsmith rolls them back by checkpoint (docs/hybrid.md): a ``Checkpoint`` of every layer's states is taken
before each step (a copy of a few small tensors), the verify runs over the whole draft as usual (chains only:
a linear-attention layer reads its tokens as one sequence, so a tree's siblings would see each other), and
when fewer tokens than were verified are accepted, the checkpoint is restored and the accepted tokens run
through the target again: in front of the next step's draft, inside its verify (the generator's default,
``rollback="merged"``), or at once in a forward of their own (``rollback="replay"``, TensorRT-LLM's way).
Either leaves every state exactly after the accepted tokens; attention KV is untouched by this (its slots
are overwritten with the same entries).

Everything goes through transformers' own model code and its own ``LinearAttentionLayer`` (the cache
interface every hybrid model in transformers 5.x calls: ``get_conv_state``, ``update_conv_state``,
``get_recurrent_state``, ``update_recurrent_state``, ``is_recording_past``): no model is re-implemented.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from draftsmith.target import positions

try:  # transformers >= 5.24: one cache interface for every hybrid model's recurrent layers
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer
except ImportError:  # older transformers: hybrid models keep model-specific caches (refused by check_supported)
    LinearAttentionCacheLayerMixin = LinearAttentionLayer = None

# Layer types (``config.layer_types`` / ``layers_block_type``) whose layers keep a state that is not KV.
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "mamba")
# Mask keys a hybrid model's forward looks up for its recurrent layers (a 2D padding mask or None).
RECURRENT_MASK_KEYS = ("linear_attention", "conv")


def layer_types(model_or_config) -> list[str]:
    """The target's per-layer types (empty when it declares none)."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("layer_types", "layers_block_type"):
        types = getattr(config, name, None)
        if isinstance(types, (list, tuple)):
            return [str(t) for t in types]
    return []


def is_hybrid(model_or_config) -> bool:
    """Whether the model keeps a recurrent or convolution state in some layer (transformers marks such
    models ``_is_stateful``; their configs name the layer kinds)."""
    if getattr(model_or_config, "_is_stateful", False):
        return True
    return any(t in RECURRENT_LAYER_TYPES for t in layer_types(model_or_config))


# The hybrid families whose speculative decoding is tested lossless (tests/support/hybrids.py builds each tiny), by
# the text config's ``model_type``, with the kind of their recurrent layers: each goes through transformers'
# own ``LinearAttentionLayer`` cache interface, so a checkpoint of those states rolls it back.
LAYER_KINDS = {
    "qwen3_5_text": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet", "qwen3_next": "Gated DeltaNet",
    "olmo_hybrid": "Gated DeltaNet", "lara_mini": "Gated DeltaNet",
    "kimi_linear": "Kimi Delta Attention", "bailing_hybrid": "Kimi Delta Attention",
    "nemotron_h": "Mamba-2", "falcon_h1": "Mamba-2", "bamba": "Mamba-2", "granitemoehybrid": "Mamba-2",
    "zamba2": "Mamba-2",
    "jamba": "Mamba-1", "zamba": "Mamba-1",
    "lfm2": "short conv", "lfm2_moe": "short conv", "lfm3": "short conv",
}
# Stateful families transformers ships that cannot be verified through its own model code: model_type ->
# (layer kind, why). The first two keep their state outside transformers' cache interface; the rest have no
# attention layer (no position_ids / 4D-mask forward to verify a draft through).
REFUSED_KINDS = {
    "minimax": ("lightning attention", "keeps its state in MiniMaxCache, a cache class of its own"),
    "recurrent_gemma": ("RG-LRU recurrent block", "keeps its state on the module, outside the cache, and restarts "
                        "it on every forward of several tokens (a verify)"),
    "mamba": ("Mamba-1", "has no attention layer"), "falcon_mamba": ("Mamba-1", "has no attention layer"),
    "mamba2": ("Mamba-2", "has no attention layer"),
    "rwkv": ("RWKV time mixing", "has no attention layer and keeps its state outside transformers' cache"),
    "xlstm": ("mLSTM", "has no attention layer and keeps its state in xLSTMCache, a cache class of its own"),
}


def model_type(model_or_config) -> str:
    """The text config's ``model_type`` (a multimodal model's language part)."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(config, "model_type", ""))


def layer_kind(model_or_config) -> str:
    """The kind of a supported hybrid's recurrent layers ("Gated DeltaNet", "Mamba-2", ...)."""
    kind = LAYER_KINDS.get(model_type(model_or_config))
    if kind is None:
        raise ValueError(unsupported(model_or_config))
    return kind


def unsupported(model_or_config) -> str:
    """The one line naming a stateful model draftsmith cannot decode, and its layer kind."""
    config = getattr(model_or_config, "config", model_or_config)
    name = type(model_or_config).__name__ if isinstance(model_or_config, nn.Module) else \
        (getattr(config, "architectures", None) or [type(config).__name__])[0]
    mtype = model_type(model_or_config)
    if mtype in REFUSED_KINDS:
        kind, why = REFUSED_KINDS[mtype]
        return (f"{name} ({mtype}): its {kind} layers are not supported: the model {why}; speculative decoding "
                "supports the hybrids in docs/hybrid.md")
    kinds = "/".join(sorted(set(layer_types(model_or_config)))) or "undeclared"
    return (f"{name} ({mtype}) keeps a recurrent state in its {kinds} layers, a family draftsmith has not verified "
            f"lossless; supported hybrids: {', '.join(sorted(LAYER_KINDS))}")


def check_supported(model: nn.Module | PretrainedConfig) -> None:
    """One line for a stateful model (or its config, before the weights load) draftsmith cannot decode: a
    family outside ``LAYER_KINDS`` (refused families name their layer kind and why, ``REFUSED_KINDS``), or
    any on transformers < 5.24."""
    if model_type(model) in REFUSED_KINDS:  # a config alone need not say it is stateful (RWKV, xLSTM)
        raise ValueError(unsupported(model))
    if not is_hybrid(model):
        return
    if model_type(model) not in LAYER_KINDS:
        raise ValueError(unsupported(model))
    check_attention_layer(model)
    if LinearAttentionLayer is None:
        import transformers
        raise ValueError(f"{type(model).__name__} keeps a recurrent state ({layer_kind(model)} layers); speculative "
                         "decoding on hybrid targets needs transformers >= 5.24 (its LinearAttentionLayer cache), "
                         f"this is {transformers.__version__}")


def check_attention_layer(model_or_config) -> None:
    """One line for a hybrid with no attention layer (every layer recurrent): speculative decoding verifies a
    draft at positions in attention layers' caches (transformers' cache asks one for the sequence length)."""
    types = layer_types(model_or_config)
    if types and not any(t == "hybrid" or ("attention" in t and t not in RECURRENT_LAYER_TYPES) for t in types):
        config = getattr(model_or_config, "config", model_or_config)
        name = (getattr(config, "architectures", None) or [type(model_or_config).__name__])[0]
        raise ValueError(f"{name} ({model_type(model_or_config)}) has no attention layer (layer types: "
                         f"{', '.join(sorted(set(types)))}): speculative decoding verifies drafts through attention "
                         "layers' caches; use a model with at least one attention layer")


def check_chain_drafter(model_or_config, drafter) -> None:
    """One line, up front, for a drafter that drafts trees (a prompt lookup of several branches, itself or a
    part of it) on a hybrid, which verifies chains only: it failed mid-decode the first time two continuations
    were found."""
    if not is_hybrid(model_or_config):
        return
    for part in (drafter, *getattr(drafter, "__dict__", {}).values()):
        branches = getattr(part, "branches", 1)
        if isinstance(branches, int) and branches > 1:
            raise ValueError(f"{type(part).__name__}(branches={branches}) drafts trees; a hybrid target (recurrent "
                             "layers read a verify's tokens as one sequence) verifies chains: use branches=1")


class LinearStates:
    """Every recurrent layer's conv and recurrent states, in transformers' own ``LinearAttentionLayer``s
    (created on first use, one per layer index), behind the part of HF's ``Cache`` interface that hybrid
    layers call. ``StaticKVCache`` holds one beside its KV buffer."""

    def __init__(self) -> None:
        self.layers: dict = {}  # layer index -> LinearAttentionLayer
        # inside ``positions.recording()``: (layer, "conv"|"recurrent", state index) -> every verified position's
        # conv inputs behind the old window (B, C, K + T) or recurrent state after each token (B, T, ...)
        self.recorded: dict[tuple[int, str, int], Tensor] = {}

    def _layer(self, layer_idx: int):
        layer = self.layers.get(layer_idx)
        if layer is None:
            layer = self.layers[layer_idx] = LinearAttentionLayer()
        return layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        layer = self.layers.get(layer_idx)
        return layer.conv_states[state_idx] if layer is not None and layer.has_previous_state[state_idx] else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        layer = self.layers.get(layer_idx)
        return layer.recurrent_states[state_idx] if layer is not None and layer.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        layer = self._layer(layer_idx)
        had_state = layer.has_previous_state[state_idx]
        full = layer.update_conv_state(conv_states, state_idx, **kwargs)  # the old window, then the new inputs
        if had_state and positions.on():
            self.recorded[(layer_idx, "conv", state_idx)] = full
        return full

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        if positions.on() and self._layer(layer_idx).has_previous_state[state_idx]:
            states = positions.take(recurrent_states)
            if states is None:
                raise RuntimeError(f"recurrent layer {layer_idx}'s rule kept no per-position states (it is not routed "
                                   "through target.delta_rule): rollback='recorded' cannot run on this target")
            self.recorded[(layer_idx, "recurrent", state_idx)] = states
        return self._layer(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def keep(self, kept: list[int]) -> None:
        """After a recorded verify: row b's states become those after its first ``kept[b]`` verified tokens, where
        ``0 < kept[b] <`` the verified width (others keep the verify's). Every recurrent layer must have recorded."""
        recorded, self.recorded = self.recorded, {}
        for i, kind, s, tensor in _states(self.layers):
            at = recorded.get((i, kind, s))
            if at is None:
                raise RuntimeError(f"recurrent layer {i} recorded no {kind} state in the verify: rollback='recorded' "
                                   "cannot run on this target")
            conv = kind == "conv"  # conv: the window ending at token k is columns k .. k + K of the old window + inputs
            width = at.shape[-1] - tensor.shape[-1] if conv else at.shape[1]
            short = {b: k for b, k in enumerate(kept) if 0 < k < width}
            rows = [slice(None)] if len(short) == len(kept) and len(set(short.values())) == 1 else list(short)
            for b in rows:
                k = short[0 if isinstance(b, slice) else b]
                tensor[b].copy_(at[b, ..., k: k + tensor.shape[-1]] if conv else at[b, k - 1])

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # transformers' own past recording stays off (its windows would grow): a recorded verify keeps
        # the concatenation ``update_conv_state`` returns itself (target.positions), the others re-run tokens

    def checkpoint(self) -> Checkpoint:
        """A copy of every state now held (taken before a step; ``restore`` puts it back)."""
        return Checkpoint({(i, kind, s): t.clone() for i, kind, s, t in _states(self.layers)})

    def current(self) -> Checkpoint:
        """The states held now, not copied (to read rows from before the next forward changes them)."""
        return Checkpoint({(i, kind, s): t for i, kind, s, t in _states(self.layers)})

    def restore(self, checkpoint: Checkpoint) -> None:
        """Put ``checkpoint``'s states back, in place (buffers keep their address: a CUDA graph replays
        on them)."""
        for i, kind, s, tensor in _states(self.layers):
            tensor.copy_(checkpoint.states[(i, kind, s)])


@dataclass
class Checkpoint:
    """Copies of recurrent-layer states keyed by (layer index, "conv"|"recurrent", state index)."""

    states: dict[tuple[int, str, int], Tensor]

    def take_rows(self, other: Checkpoint, rows: Tensor) -> None:
        """Row b of every state becomes ``other``'s where ``rows[b]`` (B,) bool."""
        for key, tensor in self.states.items():
            tensor.copy_(torch.where(rows.view(-1, *[1] * (tensor.dim() - 1)), other.states[key], tensor))


def _is_linear(layer) -> bool:
    return LinearAttentionCacheLayerMixin is not None and isinstance(layer, LinearAttentionCacheLayerMixin)


def _states(layers: dict):
    """(layer index, kind, state index, tensor) for every initialised state."""
    for i, layer in layers.items():
        for s in range(layer.number_of_states):
            if layer.is_conv_states_initialized[s]:
                yield i, "conv", s, layer.conv_states[s]
            if layer.is_recurrent_states_initialized[s]:
                yield i, "recurrent", s, layer.recurrent_states[s]


def cache_checkpoint(cache) -> tuple[list, Checkpoint]:
    """A transformers ``DynamicCache`` (of a hybrid draft model) at this point: per attention layer its length,
    or for a sliding-window layer (which drops its oldest entries as it grows, so no length cuts it back) its
    keys, values and token count; and a copy of every recurrent state (``restore_cache`` goes back to it).
    A sliding layer's tensors are kept uncopied: its ``update`` concatenates into new ones, never in place."""
    kept: list = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or not keys.numel():
            kept.append(None)
        elif getattr(layer, "is_sliding", False):
            kept.append((layer.keys, layer.values, layer.cumulative_length))
        else:
            kept.append(keys.shape[-2])
    linear = {i: layer for i, layer in enumerate(cache.layers) if _is_linear(layer)}
    return kept, Checkpoint({(i, kind, s): t.clone() for i, kind, s, t in _states(linear)})


def restore_cache(cache, checkpoint: tuple[list, Checkpoint]) -> None:
    """Cut every attention layer back to its checkpointed length (a sliding one: its kept entries) and put
    every recurrent state back."""
    kept, states = checkpoint
    for i, layer in enumerate(cache.layers):
        saved = kept[i] if i < len(kept) else None
        if isinstance(saved, tuple):
            layer.keys, layer.values, layer.cumulative_length = saved
        elif saved is not None:
            layer.keys = layer.keys[..., :saved, :]
            layer.values = layer.values[..., :saved, :]
        if _is_linear(layer):
            for s in range(layer.number_of_states):
                for kind, store in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                    state = states.states.get((i, kind, s))
                    if state is not None:
                        store[s].copy_(state)


__all__ = ["Checkpoint", "LAYER_KINDS", "LinearStates", "RECURRENT_LAYER_TYPES", "RECURRENT_MASK_KEYS", "REFUSED_KINDS",
           "cache_checkpoint", "check_supported", "is_hybrid", "layer_kind", "layer_types", "model_type",
           "restore_cache", "unsupported"]
