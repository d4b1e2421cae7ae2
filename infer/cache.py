"""The target's KV cache during speculative decoding, and its compaction after acceptance.

Two caches:
- ``StaticKVCache``, the generator's one decode state: one buffer preallocated per generation for
  prompt + max_new_tokens + the tree budget. A forward writes its T new entries at the slots the
  generator names (``slots``), attention runs over the whole buffer with a mask that hides unused
  slots, and compaction copies the accepted entries inside the buffer. Nothing is allocated or
  concatenated per step and the buffer's address never changes, so a compiled verify step (CUDA
  graphs) can be replayed on it.
- HF's ``DynamicCache``, which benchmarks use to time HF's own decode state: grows by
  concatenation; compaction gathers the accepted entries and slices the rest off.

The accepted nodes are not contiguous in the cache (the tree was laid out in depth order), so
their entries are gathered to the slots right after the prefix. Only the public per-layer
``keys``/``values`` tensors of ``DynamicCache`` are touched (no ``crop``, whose argument convention
changed across transformers 5.x).
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from heads.layers import HeadCache


class StaticKVCache:
    """Preallocated target KV for one generation: a (num_layers, 2, B, H_kv, max_len, D) buffer.

    Follows the part of HF's cache interface that decoder layers call (``update``) and that the
    generator reads (``get_seq_length``), so stock HF attention (sdpa, eager) runs on it unchanged.
    ``update`` writes the T new keys/values at ``slots`` (T,) and returns the layer's whole buffer
    (B, H_kv, max_len, D): the caller's 4D mask must block every slot that holds no valid entry
    (``infer.batch.verify_mask``). The buffer is allocated at the first ``update`` (the
    prefill), from the key's batch, heads, head dim, dtype and device, and every layer must share
    them.
    """

    is_compileable = True  # read by HF helpers that ask whether a cache can be compiled

    def __init__(self, num_layers: int, max_len: int) -> None:
        if num_layers < 1 or max_len < 1:
            raise ValueError(f"StaticKVCache needs num_layers >= 1 and max_len >= 1, got {num_layers}, {max_len}")
        self.num_layers, self.max_len = num_layers, max_len
        # per layer, as HF caches have it (transformers 5.17's mask code scans it for full layers)
        self.is_sliding = [False] * num_layers
        self.buffer: Tensor | None = None  # (L, 2, B, H_kv, max_len, D)
        self.slots: Tensor | None = None  # (T,) long: where the next forward writes
        # Eager forwards attend over the first ``window`` slots only (prefix + new tokens), as a
        # growing cache would; None = the whole buffer (a compiled step needs one shape).
        self.window: int | None = None
        self.length = 0  # valid entries: positions [0, length)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write key/value (B, H_kv, T, D) at ``slots``; return the layer's full buffers."""
        if self.buffer is None:
            shape = (self.num_layers, 2, *key.shape[:2], self.max_len, key.shape[-1])
            self.buffer = key.new_zeros(shape)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.buffer)  # fixed address: CUDA graphs replay on it
        if self.slots is None or self.slots.shape[-1] != key.shape[-2]:
            raise RuntimeError(f"StaticKVCache.slots must name {key.shape[-2]} write positions before the forward")
        if key.shape[:2] + key.shape[-1:] != self.buffer.shape[2:4] + self.buffer.shape[-1:]:
            raise ValueError(
                f"layer {layer_idx} keys have shape {tuple(key.shape)}; StaticKVCache needs every layer to share "
                f"batch, heads and head dim {tuple(self.buffer.shape[2:4])}, {self.buffer.shape[-1]}: targets whose "
                "layers differ in KV shape are not supported"
            )
        keys, values = self.buffer[layer_idx, 0], self.buffer[layer_idx, 1]  # views: (B, H_kv, M, D)
        if self.slots.dim() == 2:  # (B, T): each row writes at its own slots (a batch of ragged rows)
            index = self.slots[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[-1])
            keys.scatter_(2, index, key.to(keys.dtype))
            values.scatter_(2, index, value.to(values.dtype))
        else:
            keys.index_copy_(2, self.slots, key.to(keys.dtype))
            values.index_copy_(2, self.slots, value.to(values.dtype))
        if self.window is not None:
            return keys[:, :, : self.window], values[:, :, : self.window]  # views, no copy
        return keys, values

    @property
    def attended(self) -> int:
        """How many slots a forward's attention spans (its mask's width)."""
        return self.max_len if self.window is None else self.window

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def grow(self, max_len: int) -> None:
        """At least ``max_len`` slots, keeping every entry (an eager verify of a draft larger than the
        room left; a compiled step never grows: its drafts fit the budget the cache was sized for)."""
        if max_len <= self.max_len:
            return
        if self.buffer is not None:
            bigger = self.buffer.new_zeros(*self.buffer.shape[:4], max_len, self.buffer.shape[-1])
            bigger[..., : self.max_len, :] = self.buffer
            self.buffer = bigger
        self.max_len = max_len

    def compact(self, prefix_len: int, nodes: Tensor) -> None:
        """Keep ``[0, prefix_len)`` then the entries at ``prefix_len + nodes``, for every layer at
        once (one gather, one scatter); ``length`` becomes ``prefix_len + A``."""
        src = nodes + prefix_len  # (A,)
        dst = torch.arange(prefix_len, prefix_len + src.shape[0], device=src.device)
        if self.buffer is not None and src.numel():
            # index_select copies before index_copy_ writes: overlapping src/dst are safe.
            self.buffer.index_copy_(4, dst, self.buffer.index_select(4, src))
        self.length = prefix_len + src.shape[0]


    def compact_rows(self, lengths: Tensor, nodes: Tensor) -> None:
        """Per row b: keep ``[0, lengths[b])`` then the entries at ``lengths[b] + nodes[b]`` (B, A),
        padded with -1 past a row's accepted nodes. One fixed-size gather and scatter for every row
        and layer: a padded column copies a row's own node 0 past its kept entries, where nothing
        valid lives (the row's next verify overwrites it). ``length`` is left to the caller, which
        holds each row's length."""
        if self.buffer is None or not nodes.numel():
            return
        src = lengths[:, None] + nodes.clamp(min=0)  # (B, A)
        dst = lengths[:, None] + torch.arange(nodes.shape[1], device=nodes.device)[None]
        shape = (*self.buffer.shape[:2], -1, self.buffer.shape[3], -1, self.buffer.shape[-1])
        gather = src[None, None, :, None, :, None].expand(shape)
        self.buffer.scatter_(4, dst[None, None, :, None, :, None].expand(shape), self.buffer.gather(4, gather))


def keep_accepted(cache: DynamicCache | HeadCache | StaticHeadCache | StaticKVCache, prefix_len: int, nodes: Tensor) -> None:
    """Keep positions ``[0, prefix_len)`` then ``prefix_len + nodes`` (in that order), in place.

    ``nodes`` (A,) are accepted tree-node indices, root first; afterwards the cache holds
    ``prefix_len + A`` positions.
    """
    if isinstance(cache, StaticKVCache):
        cache.compact(prefix_len, nodes)
        return
    src = nodes + prefix_len  # (A,) absolute positions of the accepted nodes
    if isinstance(cache, (HeadCache, StaticHeadCache)):
        cache.select(torch.cat([torch.arange(prefix_len, device=src.device), src]))
        return
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"cannot compact a {type(cache).__name__}; expected DynamicCache, StaticKVCache or HeadCache")
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


class StaticHeadCache:
    """A draft head's KV cache for inference: per-layer (B, H_kv, capacity, D) buffers, written in
    place, with ``HeadCache``'s interface (``update`` returns views of the valid entries).

    ``capacity`` is reserved up front (prompt + max_new_tokens + what one draft explores), so a
    generation neither allocates nor concatenates per step; past it the buffers double (a rare
    reallocation, never wrong). Not for training: in-place writes would break autograd, which is
    why training keeps ``heads.layers.HeadCache``.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = max(1, int(capacity))
        self._keys: list[Tensor] = []
        self._values: list[Tensor] = []
        self._lengths: list[int] = []

    def update(self, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if layer_idx == len(self._keys):  # first write of this layer
            self._keys.append(key.new_zeros(*key.shape[:2], self.capacity, key.shape[-1]))
            self._values.append(value.new_zeros(*value.shape[:2], self.capacity, value.shape[-1]))
            self._lengths.append(0)
        start = self._lengths[layer_idx]
        end = start + key.shape[2]
        if end > self._keys[layer_idx].shape[2]:
            self._grow(layer_idx, end)
        self._keys[layer_idx][:, :, start:end] = key
        self._values[layer_idx][:, :, start:end] = value
        self._lengths[layer_idx] = end
        return self._keys[layer_idx][:, :, :end], self._values[layer_idx][:, :, :end]

    def _grow(self, layer_idx: int, needed: int) -> None:
        size = self._keys[layer_idx].shape[2]
        while size < needed:
            size *= 2
        for store in (self._keys, self._values):
            old = store[layer_idx]
            store[layer_idx] = torch.cat([old, old.new_zeros(*old.shape[:2], size - old.shape[2], old.shape[3])], dim=2)

    @property
    def keys(self) -> list[Tensor]:
        return [k[:, :, :n] for k, n in zip(self._keys, self._lengths)]

    @property
    def values(self) -> list[Tensor]:
        return [v[:, :, :n] for v, n in zip(self._values, self._lengths)]

    def get_seq_length(self) -> int:
        return self._lengths[0] if self._lengths else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (entries past them are left and later overwritten)."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        self._lengths = [min(n, length) for n in self._lengths]

    def select(self, index: Tensor) -> None:
        """Keep the positions ``index`` (1-D LongTensor), in that order, at the front."""
        for store in (self._keys, self._values):
            for i, buf in enumerate(store):
                buf[:, :, : index.shape[0]] = buf.index_select(2, index)
        self._lengths = [index.shape[0]] * len(self._lengths)
