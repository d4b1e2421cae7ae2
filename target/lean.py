"""Which stack an eager decode runs the target on, checked once per model: ``target.lean_forward.LeanStack`` (attention
families), ``target.lean_hybrid.HybridStack`` (hybrid families) or, where neither reproduces the backbone bit for bit,
the backbone itself (None)."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from draftsmith.target.lean_forward import LeanStack, NotLean, build_lean_stack
from draftsmith.target.lean_hybrid import HYBRIDS, HybridStack, build_hybrid_stack


def build_stack(model: nn.Module) -> LeanStack | HybridStack:
    """``model``'s hybrid stack where its decoder layers are one of ``HYBRIDS``, its lean stack otherwise, or
    ``NotLean``."""
    from draftsmith.target.model import decoder_layers

    names = {type(layer).__name__ for layer in decoder_layers(model)}
    return build_hybrid_stack(model) if names and names <= HYBRIDS.keys() else build_lean_stack(model)


_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def lean_stack(model: nn.Module) -> LeanStack | HybridStack | None:
    """``model``'s lean or hybrid stack when it can build one and, the first time for this model, it gives what the
    backbone gives bit for bit (``_agrees``; transformers may change a family's ops between versions); None otherwise
    (the caller runs the backbone)."""
    try:
        stack = build_stack(model)
    except NotLean:
        return None
    if model not in _CHECKED:
        try:
            _CHECKED[model] = _agrees(model, stack)
        except Exception:  # noqa: BLE001  (a transformers release whose backbone takes these arguments otherwise)
            _CHECKED[model] = False
    return stack if _CHECKED[model] else None


def _agrees(model: nn.Module, stack: LeanStack | HybridStack) -> bool:
    """The stack's final hidden states equal the backbone's on a causal 5-token prompt and, for a hybrid (whose layers
    branch on one token against several), then a 1-token and a 3-token step through the cache (a dynamic cache each)."""
    from transformers.cache_utils import DynamicCache

    from draftsmith.target.cache_keywords import cache_kwargs
    from draftsmith.target.model import backbone_of
    from draftsmith.target.recurrent import RECURRENT_MASK_KEYS, is_hybrid

    weight = stack.embed
    backbone = backbone_of(model)
    types = set(model.config.layer_types) if getattr(model.config, "layer_types", None) else None
    caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
    past = 0
    for length in (5, 1, 3) if is_hybrid(model.config) else (5,):  # a dynamic cache would drop a sliding layer's keys
        ids = (torch.arange(length, device=weight.device)[None] * 7 + past + 3) % weight.shape[0]
        positions = torch.arange(past, past + length, device=weight.device)[None]
        allowed = torch.ones(length, past + length, dtype=torch.bool, device=weight.device).tril_(past)
        mask = torch.zeros(1, 1, length, past + length, dtype=weight.dtype, device=weight.device).masked_fill_(
            ~allowed, torch.finfo(weight.dtype).min)
        if is_hybrid(model.config):
            masks = {"full_attention": mask, "sliding_attention": mask, **dict.fromkeys(RECURRENT_MASK_KEYS)}
        else:
            masks = {t: mask for t in types} if types and "sliding_attention" in types else mask
        with torch.inference_mode():
            ours, _ = stack(ids, masks, positions, caches[0])
            theirs = backbone(input_ids=ids, attention_mask=masks, position_ids=positions, use_cache=True,
                              **cache_kwargs(backbone, caches[1])).last_hidden_state
        if not torch.equal(ours, theirs):
            return False
        past += length
    return True


__all__ = ["build_stack", "lean_stack"]
