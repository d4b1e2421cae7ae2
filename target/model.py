"""Run the frozen target once and capture what draft heads read.

Shared by training and inference. Feature indices follow HF ``output_hidden_states``: index k is
the residual stream entering decoder layer k (0 = embeddings). Aux states are captured with forward
pre-hooks on the asked-for decoder layers only, so no (L+1)-tuple of hidden states is materialised.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache

from draftsmith.target.cache_keywords import cache_kwargs, returned_cache



@dataclass
class TargetOutput:
    """One target forward's results."""

    logits: Tensor | None  # (B, T, V); None when compute_logits=False
    final_hidden: Tensor  # (B, T, H_t) post-final-norm, the lm_head input
    aux_hidden: Tensor | None  # (B, T, len(aux_layer_ids) * H_t), low -> high; None without ids
    past_key_values: Cache | None


def causal_lm_of(model: nn.Module) -> nn.Module:
    """Unwrap a PEFT wrapper; LoRA layers are injected in place, so they still run."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack under the LM head (HF ``base_model``: e.g. ``LlamaModel``)."""
    model = causal_lm_of(model)
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if backbone is None or backbone is model:
        raise ValueError(
            f"{type(model).__name__} has no decoder backbone under "
            f"base_model_prefix={getattr(model, 'base_model_prefix', None)!r}; "
            "pass a *ForCausalLM model"
        )
    return backbone


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers, in order. Raises ValueError when the model has none."""
    layers = getattr(backbone_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(causal_lm_of(model)).__name__} exposes no decoder layers at "
            "`<backbone>.layers`; only decoder-only *ForCausalLM models are supported"
        )
    return layers


def target_forward(
    model: nn.Module,
    input_ids: Tensor,
    *,
    aux_layer_ids: Sequence[int] = (),
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values: Cache | None = None,
    use_cache: bool = False,
    compute_logits: bool = True,
) -> TargetOutput:
    """One forward of ``model`` over ``input_ids`` (B, T) returning logits and features.

    ``attention_mask`` is passed through unchanged (a 2D padding mask or a 4D additive float mask,
    see docs/design.md). ``aux_hidden`` concatenates ``hidden_states[k]`` for k in
    ``aux_layer_ids`` in the order given.
    """
    layers = decoder_layers(model)
    num_layers = len(layers)
    for k in aux_layer_ids:
        if not 0 <= k < num_layers:
            raise ValueError(f"aux layer id {k} out of range: the target has {num_layers} layers")

    captured: dict[int, Tensor] = {}

    def make_hook(k: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            captured[k] = args[0] if args else kwargs["hidden_states"]  # (B, T, H_t)

        return hook

    handles = [
        layers[k].register_forward_pre_hook(make_hook(k), with_kwargs=True)
        for k in sorted(set(aux_layer_ids))
    ]
    backbone = backbone_of(model)
    try:
        out = backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **cache_kwargs(backbone, past_key_values),
        )
    finally:
        for handle in handles:
            handle.remove()

    final_hidden = out.last_hidden_state  # (B, T, H_t)
    logits = causal_lm_of(model).get_output_embeddings()(final_hidden) if compute_logits else None
    aux = torch.cat([captured[k] for k in aux_layer_ids], dim=-1) if aux_layer_ids else None
    return TargetOutput(
        logits=logits,
        final_hidden=final_hidden,
        aux_hidden=aux,
        past_key_values=returned_cache(out) if use_cache else None,
    )


def loaded_target_identity(model: nn.Module) -> dict:
    """What a head checkpoint records about its target (name_or_path, architecture, model_type,
    hidden_size, num_layers, vocab_size, max_position_embeddings); see ``heads.common``."""
    from draftsmith.heads.common import (
        target_identity as identity,  # one definition, shared with heads
    )

    return identity(causal_lm_of(model))
