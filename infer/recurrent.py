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


def check_supported(model: nn.Module) -> None:
    """One line for a stateful model draftsmith cannot decode: one without attention layers (pure Mamba,
    RWKV, xLSTM) has no ``position_ids``/4D-mask forward to verify a draft through."""
    if not is_hybrid(model):
        return
    if LinearAttentionLayer is None:
        import transformers
        raise ValueError(f"{type(model).__name__} keeps a recurrent state; speculative decoding on hybrid targets "
                         f"needs transformers >= 5.24 (its LinearAttentionLayer cache), this is {transformers.__version__}")
    types = layer_types(model)
    if types and not any(t in ("full_attention", "sliding_attention", "hybrid") for t in types):
        kinds = sorted(set(types))
        raise ValueError(f"{type(model).__name__}: every layer is a {'/'.join(kinds)} layer (no attention); "
                         "speculative decoding supports hybrids of attention and recurrent layers only")
    if not types:
        raise ValueError(f"{type(model).__name__} keeps a recurrent state but declares no layer_types: "
                         "its recurrent layer kind is not supported")


class LinearStates:
    """Every recurrent layer's conv and recurrent states, in transformers' own ``LinearAttentionLayer``s
    (created on first use, one per layer index), behind the part of HF's ``Cache`` interface that hybrid
    layers call. ``StaticKVCache`` holds one beside its KV buffer."""

    def __init__(self) -> None:
        self.layers: dict = {}  # layer index -> LinearAttentionLayer

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
        return self._layer(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        return self._layer(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False  # rollback is by checkpoint and re-run (merged or replayed), never by recorded conv windows

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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for *_, t in _states(self.layers))


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


def cache_checkpoint(cache) -> tuple[list[int | None], Checkpoint]:
    """A transformers ``DynamicCache`` (of a hybrid draft model) at this point: each attention layer's
    length and a copy of every recurrent state (``restore_cache`` goes back to it)."""
    lengths = [layer.keys.shape[-2] if getattr(layer, "keys", None) is not None and layer.keys.numel() else None
               for layer in cache.layers]
    linear = {i: layer for i, layer in enumerate(cache.layers) if _is_linear(layer)}
    return lengths, Checkpoint({(i, kind, s): t.clone() for i, kind, s, t in _states(linear)})


def restore_cache(cache, checkpoint: tuple[list[int | None], Checkpoint]) -> None:
    """Cut every attention layer back to its checkpointed length and put every recurrent state back."""
    lengths, states = checkpoint
    for i, layer in enumerate(cache.layers):
        if i < len(lengths) and lengths[i] is not None:
            layer.keys = layer.keys[..., : lengths[i], :]
            layer.values = layer.values[..., : lengths[i], :]
        if _is_linear(layer):
            for s in range(layer.number_of_states):
                for kind, store in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                    saved = states.states.get((i, kind, s))
                    if saved is not None:
                        store[s].copy_(saved)


__all__ = ["Checkpoint", "LinearStates", "RECURRENT_LAYER_TYPES", "RECURRENT_MASK_KEYS", "cache_checkpoint",
           "check_supported", "is_hybrid", "layer_types", "restore_cache"]
