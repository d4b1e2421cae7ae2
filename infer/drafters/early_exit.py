"""The early-exit head's drafter (Kangaroo): the target's first ``exit_layer`` layers, the head's
adapter and the target's lm_head draft a chain, one token per forward.

The shallow sub-network plus adapter is a causal LM of its own (``EarlyExitLM``), so drafting is
``LMDrafter``'s: one KV cache, cut back to the tokens the target accepted before each draft, greedy
or sampled drafts (their law ``q`` goes to the lossless chain rule), and ``confidence`` stops a greedy
chain at the first draft below it (Kangaroo's early stop). The adapter's keys and values sit in the
same cache, as layer ``exit_layer``, so one cut keeps both in step.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from draftsmith.infer.drafters.base import Chain, HeadDrafter
from draftsmith.target.views import shallow_backbone
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.target.cache_keywords import cache_kwargs

DEFAULT_CHAIN = Chain(4)  # drafts per step when none is given (a CPU-sized chain, as layer skip's)


class _CacheSlot:
    """The adapter's view of the shared ``DynamicCache``: its layer ``i`` is the cache's ``offset + i``
    (``heads.layers.Attention`` calls ``update(layer_idx, key, value)``)."""

    def __init__(self, cache: DynamicCache, offset: int) -> None:
        self.cache, self.offset = cache, offset

    def update(self, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(key, value, self.offset + layer_idx)


class EarlyExitLM(nn.Module):
    """The target's first ``exit_layer`` layers, then the head, then the target's lm_head: called
    like a HF causal LM (``input_ids``, ``position_ids``, a ``DynamicCache``) and returning ``.logits``."""

    def __init__(self, head: nn.Module, target: nn.Module) -> None:
        super().__init__()
        self.exit_layer = head.config.exit_layer
        self.stack = shallow_backbone(target, self.exit_layer)
        self.head = head
        self.lm_head = target.get_output_embeddings()
        self.config = target.config  # the target's tokenizer facts, for LMDrafter's check

    def forward(self, input_ids: Tensor, position_ids: Tensor, cache: DynamicCache,
                use_cache: bool = True) -> SimpleNamespace:
        hidden = self.stack(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                            **cache_kwargs(self.stack, cache)).last_hidden_state  # (1, T, H) = target hidden_states[k]
        out = self.head(hidden, position_ids, past_key_values=_CacheSlot(cache, self.exit_layer))
        return SimpleNamespace(logits=self.lm_head(out.hidden_states))  # (1, T, V)


class EarlyExitDrafter(LMDrafter, HeadDrafter):
    """An early-exit head drafting a ``Chain`` (``confidence``: stop a greedy chain below it)."""

    def __init__(self, head: nn.Module, target: nn.Module, tree: Chain | None = None,
                 confidence: float | None = None) -> None:
        LMDrafter.__init__(self, EarlyExitLM(head, target), target, tree or DEFAULT_CHAIN, confidence)

    def _new_cache(self) -> DynamicCache:
        """The LM drafter's cache, whose layer ``exit_layer`` holds the adapter's KV: a plain attention
        layer even where the target's layer of that index is a recurrent one (a hybrid target)."""
        cache = super()._new_cache()
        if self.hybrid:
            cache.layers[self.model.exit_layer] = DynamicLayer()
        return cache

    @classmethod
    def branching_tree(cls, device: torch.device) -> None:
        """None: an early-exit head drafts chains only."""
        return None

    @classmethod
    def default_tree(cls, device: torch.device) -> Chain:
        return DEFAULT_CHAIN


DRAFTER = EarlyExitDrafter
