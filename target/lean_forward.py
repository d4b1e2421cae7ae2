"""The target's decoder stack run without the module machinery, op for op as its own forward (eager decoding).

A decode step on a small target is mostly Python: each forward of demo:tiny calls about 110 modules, each call
going through ``nn.Module.__call__``, transformers' output capturing and kwarg deprecation wrappers and a config
whose ``__getattribute__`` is instrumented; the matmuls are a third of it (docs/benchmarks.md, "The plain step").
``LeanStack`` runs the same tensor ops in the same order on the same weights, for the families whose decoder
layer it reproduces (``FAMILIES``: Llama, Mistral, Qwen2, Qwen3 and their RMSNorm, rotary embedding and gated
MLP; Mellum's dense layers), and calls transformers' own attention function (sdpa or eager, with the arguments the family passes), so
its outputs are the backbone's bit for bit; ``target.lean.lean_stack`` checks that once per model on a short prompt
and falls back to the backbone otherwise (a hybrid's stack: ``target.lean_hybrid``).

What it does not take, and leaves to the backbone: any other layer class (hybrids, MoE, Gemma's scaled
embeddings), a module whose class is not the family's own (PEFT's LoRA layers, quantized linears, hub kernels
that replaced a ``forward``), forward hooks, training mode, and ``inputs_embeds`` (a drafter's entry model).
Hooks added after ``target.lean.lean_stack`` built the stack are not seen: the generator builds it again at every
prefill.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# decoder layer class -> (its attention's extra keyword for the attention function, q/k norms on the head dim,
# a rotary embedding per layer type)
FAMILIES = {
    "LlamaDecoderLayer": (None, False, False),
    "MistralDecoderLayer": ("config", False, False),  # sliding_window=config.sliding_window
    "Qwen2DecoderLayer": ("attention", False, False),  # sliding_window=self_attn.sliding_window
    "Qwen3DecoderLayer": ("attention", True, False),
    "MellumDecoderLayer": ("attention", True, True),  # dense layers only (MellumMLP): MoE layers run the backbone
}


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The families' RMSNorm (``LlamaRMSNorm.forward``): in float32, scaled by the weight in the input's dtype."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class _Layer:
    attn: nn.Module  # passed to the attention function (it reads num_key_value_groups, training, is_causal)
    index: int
    norm_in: tuple[Tensor, float]
    norm_post: tuple[Tensor, float]
    q: tuple[Tensor, Tensor | None]
    k: tuple[Tensor, Tensor | None]
    v: tuple[Tensor, Tensor | None]
    o: tuple[Tensor, Tensor | None]
    q_norm: tuple[Tensor, float] | None
    k_norm: tuple[Tensor, float] | None
    gate: tuple[Tensor, Tensor | None]
    up: tuple[Tensor, Tensor | None]
    down: tuple[Tensor, Tensor | None]
    act: Callable[[Tensor], Tensor]
    head_dim: int
    scaling: float
    extra: dict
    layer_type: str | None


class LeanStack:
    """The decoder layers and final norm of one target, as tensors (see the module's docstring)."""

    def __init__(self, backbone: nn.Module, layers: list[nn.Module], attention: Callable, layer_types) -> None:
        self.embed = backbone.embed_tokens.weight
        self.rotary = backbone.rotary_emb
        self.norm = norm_weights(backbone.norm)
        self.attention = attention
        self.layers = [build_layer(layer, i, layer_types) for i, layer in enumerate(layers)]
        self.rope_per_type = FAMILIES[type(layers[0]).__name__][2]

    def __call__(self, input_ids: Tensor, mask: Tensor | dict[str, Tensor], positions: Tensor, cache,
                 aux_layer_ids: tuple[int, ...] = ()) -> tuple[Tensor, Tensor | None]:
        """(final hidden (B, T, H) after the final norm, the residual streams entering ``aux_layer_ids``
        concatenated, or None): what the backbone's forward gives for the same arguments."""
        h = F.embedding(input_ids, self.embed)
        if self.rope_per_type:
            rope = {t: self.rotary(h, positions, t) for t in {layer.layer_type for layer in self.layers}}
        else:
            rope = dict.fromkeys({layer.layer_type for layer in self.layers}, self.rotary(h, position_ids=positions))
        rope = {t: (cos.unsqueeze(1), sin.unsqueeze(1)) for t, (cos, sin) in rope.items()}
        entering = {}
        for layer in self.layers:
            if layer.index in aux_layer_ids:
                entering[layer.index] = h
            m = mask if not isinstance(mask, dict) else mask[layer.layer_type]
            h = run_layer(layer, self.attention, h, *rope[layer.layer_type], m, cache)
        aux = torch.cat([entering[k] for k in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return rms(h, *self.norm), aux



def run_layer(layer: _Layer, attention: Callable, h: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
              cache) -> Tensor:
    """One decoder layer (``build_layer``'s) over the residual stream ``h`` (B, T, H) at the rotary ``cos``/``sin``
    (B, 1, T, D), as its module's forward: the family's norms, projections, rotary, ``cache.update`` (None: no
    cache), transformers' ``attention`` function and gated MLP."""
    shape = (*h.shape[:-1], -1, layer.head_dim)
    x = rms(h, *layer.norm_in)
    q, k = F.linear(x, *layer.q).view(shape), F.linear(x, *layer.k).view(shape)
    if layer.q_norm is not None:
        q, k = rms(q, *layer.q_norm), rms(k, *layer.k_norm)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), F.linear(x, *layer.v).view(shape).transpose(1, 2)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    if cache is not None:
        k, v = cache.update(k, v, layer.index)
    out, _ = attention(layer.attn, q, k, v, mask, dropout=0.0, scaling=layer.scaling, **layer.extra)
    h = h + F.linear(out.reshape(*h.shape[:-1], -1).contiguous(), *layer.o)
    x = rms(h, *layer.norm_post)
    return h + F.linear(layer.act(F.linear(x, *layer.gate)) * F.linear(x, *layer.up), *layer.down)


def linear_weights(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    if type(module) is not nn.Linear:
        raise NotLean(f"{type(module).__name__} is not a plain nn.Linear")
    return module.weight, module.bias


def norm_weights(module: nn.Module) -> tuple[Tensor, float]:
    """(weight, eps) of one of ``FAMILIES``' RMSNorms (``LlamaRMSNorm``'s formula; not Gemma's or Qwen3-Next's 1 + w)."""
    name = type(module).__name__
    if name not in {f.replace("DecoderLayer", "RMSNorm") for f in FAMILIES} or not own(type(module)):
        raise NotLean(f"{name} is not one of the families' RMSNorms")
    return module.weight, module.variance_epsilon


def own(cls: type) -> bool:
    return cls.__module__.startswith("transformers.models.")


def build_layer(layer: nn.Module, index: int, layer_types) -> _Layer:
    """A decoder layer of one of ``FAMILIES`` as tensors (``run_layer`` runs it); ``NotLean`` for anything else."""
    if type(layer).__name__ not in FAMILIES or not own(type(layer)):
        raise NotLean(f"a {type(layer).__name__}")
    extra_kind, qk_norm, _ = FAMILIES[type(layer).__name__]
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn).__name__ != type(layer).__name__.replace("DecoderLayer", "Attention"):
        raise NotLean(f"{type(attn).__name__} is not the family's attention")
    if type(mlp).__name__ != type(layer).__name__.replace("DecoderLayer", "MLP"):
        raise NotLean(f"{type(mlp).__name__} is not the family's MLP")
    if getattr(attn, "layer_idx", index) != index:
        raise NotLean(f"layer {index}'s attention has layer_idx {attn.layer_idx}")
    extra = {}
    if extra_kind == "config":
        extra = {"sliding_window": getattr(attn.config, "sliding_window", None)}
    elif extra_kind == "attention":
        extra = {"sliding_window": attn.sliding_window}
    act = mlp.act_fn
    if isinstance(act, nn.Module):
        act = act.forward
    lin = linear_weights
    return _Layer(attn, index, norm_weights(layer.input_layernorm), norm_weights(layer.post_attention_layernorm),
                  lin(attn.q_proj), lin(attn.k_proj), lin(attn.v_proj), lin(attn.o_proj),
                  norm_weights(attn.q_norm) if qk_norm else None, norm_weights(attn.k_norm) if qk_norm else None,
                  lin(mlp.gate_proj), lin(mlp.up_proj), lin(mlp.down_proj), act,
                  attn.head_dim, attn.scaling, extra, None if layer_types is None else layer_types[index])


def _foreign_hooks(module: nn.Module) -> list:
    """``module``'s forward hooks but transformers' own output capturing (inactive unless a forward asks it for
    outputs: the lean stack computes the states it needs itself)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [h for h in hooks if getattr(h, "__module__", None) != "transformers.utils.output_capturing"]


def check_modules(root: nn.Module) -> None:
    """``NotLean`` where a module under ``root`` has a forward hook (but transformers' own output capturing), an
    accelerate hook or a replaced ``forward`` (a kernel swapped in): what the lean ops would skip."""
    for m in root.modules():
        if _foreign_hooks(m) or hasattr(m, "_hf_hook") or (m is not root and "forward" in vars(m)):
            raise NotLean(f"a forward hook or a replaced forward on {type(m).__name__}")


class NotLean(Exception):
    """Why a target runs its own forward."""


def attention_function(config, family_module) -> Callable:
    """transformers' attention function the family's attention calls under ``config`` (sdpa or eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(config, "_attn_implementation", None)
    if impl in (None, "eager"):  # None: a module built on its own (an MTP head's layers), eager as transformers runs it
        return family_module.eager_attention_forward
    if impl == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    raise NotLean(f"attention {impl!r}")


def check_model(model: nn.Module, families) -> tuple[nn.Module, list[nn.Module]]:
    """(backbone, decoder layers) of ``model`` (a *ForCausalLM) when a lean stack may stand in for it: every layer
    one transformers class named in ``families`` and a plain embedding; ``NotLean`` for a PEFT wrapper, training
    mode, global forward hooks, a module ``check_modules`` refuses, or other layers."""
    from torch.nn.modules import module as module_globals

    from draftsmith.target.model import backbone_of, causal_lm_of, decoder_layers

    if causal_lm_of(model) is not model:
        raise NotLean("a PEFT wrapper")
    if model.training:
        raise NotLean("training mode")
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        raise NotLean("global forward hooks")
    check_modules(model)
    backbone = backbone_of(model)
    layers = list(decoder_layers(model))[: model.config.num_hidden_layers]
    names = {type(layer).__name__ for layer in layers}
    if len(names) != 1 or not names <= families.keys() or not own(type(layers[0])):
        raise NotLean(f"decoder layers {sorted(names)}")
    if type(backbone.embed_tokens) is not nn.Embedding:
        raise NotLean("the embedding is not an nn.Embedding")
    return backbone, layers


def build_lean_stack(model: nn.Module) -> LeanStack:
    """The lean stack of ``model`` (a *ForCausalLM), or ``NotLean`` naming what it cannot reproduce."""
    backbone, layers = check_model(model, FAMILIES)
    if type(backbone.rotary_emb).__name__ != type(layers[0]).__name__.replace("DecoderLayer", "RotaryEmbedding"):
        raise NotLean("the rotary embedding is not the family's")
    layer_types = getattr(model.config, "layer_types", None)
    attention = attention_function(model.config, sys.modules[type(layers[0]).__module__])
    return LeanStack(backbone, layers, attention, layer_types)


__all__ = ["FAMILIES", "LeanStack", "NotLean", "attention_function", "build_layer", "build_lean_stack", "check_model",
           "check_modules", "linear_weights", "norm_weights", "own", "rms", "run_layer"]
