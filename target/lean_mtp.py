"""A target's MTP layers run as ``target.lean_forward`` runs its trunk: the same ops without the module machinery.

transformers' ``modeling_layers.MtpLayer`` (what ``heads.mtp``'s head is made of): ``enorm`` of the next token's
embedding and ``hnorm`` of the previous hidden state, concatenated (hidden first where the config says
``mtp_hidden_states_first``), ``eh_proj``, the family's decoder layer (``mtp_block``), ``post_norm``. ``LeanMtpLayer``
is called as the module is; ``lean_mtp_layers`` builds one per layer where the block's family is one of
``lean_forward.FAMILIES`` and, once per head, checks that its output equals the module's bit for bit on a short
input (None otherwise: the drafter runs the modules).
"""
from __future__ import annotations

import sys
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.target.lean_forward import (NotLean, attention_function, build_layer, check_modules, linear_weights,
                                            norm_weights, rms, run_layer)


class LeanMtpLayer:
    """One ``MtpLayer`` as tensors; called with ``MtpLayer.forward``'s arguments."""

    def __init__(self, layer: nn.Module) -> None:
        if type(layer).__name__ != "MtpLayer" or type(layer).__module__ != "transformers.modeling_layers":
            raise NotLean(f"a {type(layer).__name__}")
        if layer.training:
            raise NotLean("training mode")
        check_modules(layer)
        block, config = layer.mtp_block, layer.config
        self.hidden_first = bool(getattr(config, "mtp_hidden_states_first", False))
        self.enorm, self.hnorm = norm_weights(layer.enorm), norm_weights(layer.hnorm)
        self.eh_proj = linear_weights(layer.eh_proj)
        self.post_norm = norm_weights(layer.post_norm) if layer.use_post_norm else None
        self.block = build_layer(block, block.self_attn.layer_idx, None)  # one mask for the block: no layer types
        self.attention = attention_function(config, sys.modules[type(block).__module__])

    def __call__(self, inputs_embeds: Tensor, previous_hidden_state: Tensor, position_embeddings: tuple[Tensor, Tensor],
                 attention_mask: Tensor | None, position_ids: Tensor | None, cache) -> Tensor:
        e, h = rms(inputs_embeds, *self.enorm), rms(previous_hidden_state, *self.hnorm)
        x = F.linear(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1), *self.eh_proj)
        cos, sin = position_embeddings
        x = run_layer(self.block, self.attention, x, cos.unsqueeze(1), sin.unsqueeze(1), attention_mask, cache)
        return rms(x, *self.post_norm) if self.post_norm is not None else x


_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def lean_mtp_layers(layers: nn.ModuleList, rotary: nn.Module,
                    rope_types: list[str] | None) -> list[LeanMtpLayer] | None:
    """Each of ``layers`` (``MtpLayer``s) as a ``LeanMtpLayer``, or None where one cannot be built or, the first time
    for these layers, one's output differs from its module's on 3 positions (no cache, causal by the attention's own
    rule); ``rotary`` (x, positions[, layer type]) -> (cos, sin) and ``rope_types`` as the head passes them."""
    try:
        lean = [LeanMtpLayer(layer) for layer in layers]
    except NotLean:
        return None
    if layers not in _CHECKED:
        try:
            _CHECKED[layers] = all(_agrees(layer, mine, rotary, rope_types, i) for i, (layer, mine) in
                                   enumerate(zip(layers, lean)))
        except Exception:  # noqa: BLE001  (a release whose MtpLayer is called otherwise: the modules run)
            _CHECKED[layers] = False
    return lean if _CHECKED[layers] else None


def _agrees(layer: nn.Module, lean: LeanMtpLayer, rotary: nn.Module, rope_types: list[str] | None, i: int) -> bool:
    weight = layer.eh_proj.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    embeds, hidden = (torch.randn(1, 3, weight.shape[0], generator=gen).to(weight) for _ in range(2))
    positions = torch.arange(3, device=weight.device)[None]
    rope = rotary(embeds, positions, *((rope_types[i],) if rope_types else ()))
    with torch.inference_mode():
        return torch.equal(lean(embeds, hidden, rope, None, positions, None),
                           layer(embeds, hidden, rope, None, positions, None))


__all__ = ["LeanMtpLayer", "lean_mtp_layers"]
