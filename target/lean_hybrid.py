"""A hybrid target's decoder stack run with less of the module machinery (eager decoding; docs/hybrid.md, "The
hybrid stack without its module calls").

``target.lean_forward`` runs an attention target's layers as tensor ops. A hybrid's recurrent mixers hold most of its
code (a conv window, a scan routed per verify by ``target.delta_rule``, states recorded for the rollback by
``target.positions``), so ``HybridStack`` keeps their calls as they are and removes the rest: the backbone's and the
layers' ``__call__`` (hooks, output capturing, kwarg deprecation wrappers, a config property rebuilt at every
layer), the norms and the gated MLPs, which it runs as the same tensor ops on the same weights, for the families in
``HYBRIDS`` (Qwen3.5's Gated DeltaNet, Bamba's Mamba-2, LFM2's short conv). Each attention, Mamba-2 and short-conv
mixer runs its module's own ``forward`` with the arguments its decoder layer passes; Qwen3.5's Gated DeltaNet
mixer runs as ``LeanGatedDeltaNet`` (its forward's ops, with the same cache calls and the same module-level conv and
delta-rule functions, looked up per call). So every cache call, routed rule and recorded state is theirs.
``target.lean.lean_stack`` builds it for ``HYBRIDS`` and checks it once per model against the backbone, bit for bit,
over a prompt and two cached steps.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.target.lean_forward import NotLean, check_model, linear_weights, own, rms


@dataclass(frozen=True)
class Family:
    """Where a hybrid family's decoder layer keeps its parts, and what its forward passes them."""

    mixer: str  # the recurrent mixer's attribute (attention layers: ``self_attn``)
    recurrent: str  # the recurrent layers' kind: the config's name for them and the backbone's mask key
    kinds: str  # the config property naming each layer's kind
    norms: tuple[str, str]  # the norm before the mixer, the norm before the MLP
    final_norm: str  # the backbone's final norm
    mlp: tuple[str, str, str, str]  # the MLP's attribute, then its gate, up and down projections
    mrope: bool = False  # positions as Qwen3.5's mRoPE (its text positions for the layers, three sections for rotary)
    mixer_kwargs: dict = field(default_factory=dict)  # what the layer passes its mixer beyond states, cache and mask
    attention_kwargs: dict = field(default_factory=dict)  # what it passes its attention beyond those and positions


# decoder layer class -> its family
HYBRIDS = {
    "BambaDecoderLayer": Family("mamba", "linear_attention", "layers_block_type",
                                ("input_layernorm", "pre_ff_layernorm"), "final_layernorm",
                                ("feed_forward", "gate_proj", "up_proj", "down_proj"),
                                attention_kwargs={"use_cache": True}),
    "Qwen3_5DecoderLayer": Family("linear_attn", "linear_attention", "layer_types",
                                  ("input_layernorm", "post_attention_layernorm"), "norm",
                                  ("mlp", "gate_proj", "up_proj", "down_proj"), mrope=True,
                                  mixer_kwargs={"use_cache": True}, attention_kwargs={"use_cache": True}),
    "Lfm2DecoderLayer": Family("conv", "conv", "layer_types", ("operator_norm", "ffn_norm"), "embedding_norm",
                               ("feed_forward", "w1", "w3", "w2")),  # LFM2's MLP: w2(silu(w1(x)) * w3(x))
}
# Llama's x * w, Qwen3.5's x * (1 + w) in fp32
_NORMS = {"BambaRMSNorm": "weight", "Lfm2RMSNorm": "weight", "Qwen3_5RMSNorm": "offset"}


def rms_offset(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's RMSNorm (``Qwen3_5RMSNorm.forward``): normalised in float32, scaled by 1 + weight, cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


class LeanGatedDeltaNet:
    """Qwen3.5's Gated DeltaNet mixer (``Qwen3_5GatedDeltaNet.forward``, transformers 5.24) as its tensor ops on its
    weights: the projections as ``F.linear``, its gated RMSNorm inline, and the cache calls, the conv functions and
    the two delta rules its forward makes, each looked up in its modeling module at every call (so the generator's
    routing, ``target.delta_rule``, applies as to the module). The hybrid stack's check compares it with the module."""

    def __init__(self, mixer: nn.Module) -> None:
        self.module = sys.modules[type(mixer).__module__]
        self.index, self.head_k, self.head_v = mixer.layer_idx, mixer.head_k_dim, mixer.head_v_dim
        self.key_dim, self.value_dim, self.kernel = mixer.key_dim, mixer.value_dim, mixer.conv_kernel_size
        self.activation, self.conv = mixer.activation, (mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias)
        self.qkv, self.z = linear_weights(mixer.in_proj_qkv), linear_weights(mixer.in_proj_z)
        self.b, self.a, self.out = linear_weights(mixer.in_proj_b), linear_weights(mixer.in_proj_a), linear_weights(
            mixer.out_proj)
        self.A_log, self.dt_bias = mixer.A_log, mixer.dt_bias
        norm = mixer.norm
        if type(norm).__name__ != "Qwen3_5RMSNormGated" or not own(type(norm)) or norm.activation != "silu":
            raise NotLean(f"{type(norm).__name__} is not Qwen3.5's gated RMSNorm")
        self.norm = (norm.weight, norm.variance_epsilon, self.module.ACT2FN[norm.activation])

    def __call__(self, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor:
        m = self.module
        hidden_states = m.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch, length, _ = hidden_states.shape
        conv_state = recurrent_state = None
        if cache is not None:
            conv_state = cache.get_conv_state(self.index, state_idx=0)
            recurrent_state = cache.get_recurrent_state(self.index, state_idx=0)
        mixed = F.linear(hidden_states, *self.qkv).transpose(1, 2)
        z = F.linear(hidden_states, *self.z).reshape(batch, length, -1, self.head_v)
        b, a = F.linear(hidden_states, *self.b), F.linear(hidden_states, *self.a)
        if conv_state is not None and length == 1 and not cache.is_recording_past(self.index):
            mixed = m.causal_conv1d_update(mixed, conv_state, *self.conv, self.activation)
        else:
            if cache is not None:
                mixed = cache.update_conv_state(mixed, self.index, conv_kernel_size=self.kernel)
            mixed = m.causal_conv1d_fn(mixed, *self.conv, activation=self.activation, **kwargs)
            if cache is not None:
                mixed = mixed[:, :, -length:]
        query, key, value = torch.split(mixed.transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, length, -1, self.head_k)
        key = key.reshape(batch, length, -1, self.head_k)
        value = value.reshape(batch, length, -1, self.head_v)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rule = m.torch_recurrent_gated_delta_rule if recurrent_state is not None and length == 1 else \
            m.torch_chunk_gated_delta_rule
        out, last = rule(query, key, value, g=g, beta=beta, initial_state=recurrent_state,
                         output_final_state=cache is not None, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=kwargs.pop("cu_seq_lens_q", None), **kwargs)
        if cache is not None:
            cache.update_recurrent_state(last, self.index)
        weight, eps, act = self.norm  # Qwen3_5RMSNormGated.forward
        x, z = out.reshape(-1, self.head_v), z.reshape(-1, self.head_v)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x = weight * x.to(dtype)
        x = (x * act(z.to(torch.float32))).to(dtype)
        return F.linear(x.reshape(batch, length, -1), *self.out)


LEAN_MIXERS: dict[str, Callable] = {"Qwen3_5GatedDeltaNet": LeanGatedDeltaNet}  # a mixer class -> its lean replica


@dataclass
class _Layer:
    kind: str  # the mask key: the family's recurrent kind or "full_attention"
    mixer: Callable  # the recurrent mixer's or the attention's own forward
    attention: bool
    norm_in: tuple[Callable, Tensor, float]
    norm_post: tuple[Callable, Tensor, float]
    gate: tuple[Tensor, Tensor | None]
    up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]
    act: Callable[[Tensor], Tensor]


def _norm(module: nn.Module) -> tuple[Callable, Tensor, float]:
    name = type(module).__name__
    if name not in _NORMS or not own(type(module)):
        raise NotLean(f"{name} is not one of the hybrids' RMSNorms")
    if _NORMS[name] == "weight":
        return rms, module.weight, module.variance_epsilon
    return rms_offset, module.weight, module.eps


def _layer(layer: nn.Module, kind: str, family: Family) -> _Layer:
    attention = kind == "full_attention"
    mixer = getattr(layer, "self_attn" if attention else family.mixer, None)
    if mixer is None:
        raise NotLean(f"a {kind} layer without its mixer")
    mlp_name, *projections = family.mlp
    mlp = getattr(layer, mlp_name)
    if not type(mlp).__name__.endswith("MLP") or not set(projections) <= mlp._modules.keys() or not own(type(mlp)):
        raise NotLean(f"{type(mlp).__name__} is not the family's gated MLP")
    act = getattr(mlp, "act_fn", F.silu)  # LFM2's MLP calls F.silu itself
    act = act.forward if isinstance(act, nn.Module) else act
    lean = LEAN_MIXERS.get(type(mixer).__name__)
    run = lean(mixer) if lean is not None and own(type(mixer)) else mixer.forward
    return _Layer(kind, run, attention, *(_norm(getattr(layer, n)) for n in family.norms),
                  *(linear_weights(getattr(mlp, n)) for n in projections), act)


class HybridStack:
    """The decoder layers and final norm of one hybrid target (see the module's docstring); called as
    ``lean_forward.LeanStack``."""

    def __init__(self, backbone: nn.Module, layers: list[nn.Module], kinds: list[str]) -> None:
        self.family = family = HYBRIDS[type(layers[0]).__name__]
        self.embed = backbone.embed_tokens.weight
        self.rotary = backbone.rotary_emb
        self.norm = _norm(getattr(backbone, family.final_norm))
        self.layers = [_layer(layer, kind, family) for layer, kind in zip(layers, kinds)]

    def __call__(self, input_ids: Tensor, mask: dict[str, Tensor | None], positions: Tensor, cache,
                 aux_layer_ids: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
        """(final hidden (B, T, H) after the final norm, the residual streams entering ``aux_layer_ids``
        concatenated, or None): what the backbone's forward gives for the same arguments (``mask``: the dict of
        masks per layer kind the generator passes a hybrid)."""
        if not isinstance(mask, dict):
            raise NotLean("a hybrid stack takes the masks per layer kind")
        h = F.embedding(input_ids, self.embed)
        family, text_positions = self.family, positions
        if family.mrope:  # Qwen3.5: text positions for the layers, the three mRoPE sections for the rotary
            positions = positions[None].expand(4, *positions.shape)
            text_positions, positions = positions[0], positions[1:]
        rope = self.rotary(h, positions)
        entering = {}
        for index, layer in enumerate(self.layers):
            if index in aux_layer_ids:
                entering[index] = h
            norm, weight, eps = layer.norm_in
            x = norm(h, weight, eps)
            if layer.attention:
                x, _ = layer.mixer(hidden_states=x, attention_mask=mask[layer.kind], position_ids=text_positions,
                                   cache=cache, position_embeddings=rope, **family.attention_kwargs)
            else:
                x = layer.mixer(hidden_states=x, cache=cache, attention_mask=mask[layer.kind], **family.mixer_kwargs)
            h = h + x
            norm, weight, eps = layer.norm_post
            x = norm(h, weight, eps)
            h = h + F.linear(layer.act(F.linear(x, *layer.gate)) * F.linear(x, *layer.up), *layer.down)
        aux = torch.cat([entering[k] for k in aux_layer_ids], dim=-1) if aux_layer_ids else None
        norm, weight, eps = self.norm
        return norm(h, weight, eps), aux


def build_hybrid_stack(model: nn.Module) -> HybridStack:
    """The hybrid stack of ``model`` (a *ForCausalLM whose decoder layers are all one of ``HYBRIDS``), or
    ``NotLean`` naming what it cannot reproduce."""
    backbone, layers = check_model(model, HYBRIDS)
    family = HYBRIDS[type(layers[0]).__name__]
    kinds = list(getattr(backbone.config, family.kinds))[: len(layers)]
    if set(kinds) - {family.recurrent, "full_attention"}:
        raise NotLean(f"layer kinds {sorted(set(kinds))}")
    return HybridStack(backbone, layers, kinds)


__all__ = ["HYBRIDS", "LEAN_MIXERS", "Family", "LeanGatedDeltaNet", "HybridStack", "build_hybrid_stack", "rms_offset"]
