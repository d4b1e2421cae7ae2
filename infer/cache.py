"""KV-cache compaction after acceptance: keep the prefix and the accepted tree nodes.

The accepted nodes are not contiguous in the cache (the tree was laid out in depth order), so
their entries are gathered to the slots right after the prefix and the rest is dropped. Only the
public per-layer ``keys``/``values`` tensors of ``DynamicCache`` are touched (no ``crop``, whose
argument convention changed across transformers 5.x).
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from heads.layers import HeadCache


def keep_accepted(cache: DynamicCache | HeadCache, prefix_len: int, nodes: Tensor) -> None:
    """Keep positions ``[0, prefix_len)`` then ``prefix_len + nodes`` (in that order), in place.

    ``nodes`` (A,) are accepted tree-node indices, root first; afterwards the cache holds
    ``prefix_len + A`` positions.
    """
    src = nodes + prefix_len  # (A,) absolute positions of the accepted nodes
    if isinstance(cache, HeadCache):
        cache.select(torch.cat([torch.arange(prefix_len, device=src.device), src]))
        return
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"cannot compact a {type(cache).__name__}; expected DynamicCache or HeadCache")
    end = prefix_len + src.shape[0]
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise ValueError("sliding-window cache layers cannot be compacted; build a plain DynamicCache()")
        kept_k = layer.keys.index_select(-2, src)  # (B, H_kv, A, D); gathered before overwriting
        kept_v = layer.values.index_select(-2, src)
        # The prefix stays where it is: only A slots are written, and the slice is a view.
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
        layer.keys[..., prefix_len:end, :] = kept_k
        layer.values[..., prefix_len:end, :] = kept_v
