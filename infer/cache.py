"""The caches of speculative decoding, each preallocated once per generation and written in place.

- ``StaticKVCache``: the target's KV (and a hybrid's recurrent states, ``states``), the generator's one decode
  state: one buffer for prompt + max_new_tokens + the tree budget. A forward writes its T new entries at the
  slots the generator names (``slots``), attention runs over the buffer with a mask that hides unused slots, and
  ``compact_rows`` gathers each row's accepted entries to the slots right after its prefix (the accepted nodes are
  not contiguous: the tree was laid out in depth order). Nothing is allocated or concatenated per step and the
  buffer's address never changes, so a compiled verify step (CUDA graphs) can be replayed on it.
- ``StaticHeadCache``: a draft head's K/V, a row per batch row (``row(b)`` -> ``HeadCacheRow``), with
  ``SlotWrites``, ``slot_mask`` and ``block_slot_mask`` for compiled draft steps that write at device slots.
- ``crop_dynamic``: a draft LM's (or the verify-cost benchmark's) HF ``DynamicCache`` cut back to its first
  positions, touching only the public per-layer ``keys``/``values`` (no ``crop``, whose argument convention
  changed across transformers 5.x).
"""
from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from draftsmith.heads.layers import additive_mask
from draftsmith.target.recurrent import LinearStates


class StaticKVCache:
    """Preallocated target KV for one generation: a (num_layers, 2, B, H_kv, max_len, D) buffer.

    Follows the part of HF's cache interface that decoder layers call (``update``) and that the
    generator reads (``get_seq_length``), so stock HF attention (sdpa, eager) runs on it unchanged.
    ``update`` writes the T new keys/values at ``slots`` (T,) and returns the layer's whole buffer
    (B, H_kv, max_len, D): the caller's 4D mask must block every slot that holds no valid entry
    (``infer.masked_forward.verify_mask``). The buffer is allocated at the first ``update`` (the
    prefill), from the key's batch, heads, head dim, dtype and device, and every layer must share
    them. Keys and values may differ in their last dim (Kimi-Linear's and Bailing's MLA layers cache
    the compressed latent (B, 1, T, kv_lora_rank) as keys and the rope part (B, 1, T, rope_dim) as
    values): D is the larger, and each is written to and read from its own first dims.
    """

    is_compileable = True  # read by HF helpers that ask whether a cache can be compiled

    def __init__(self, num_layers: int, max_len: int) -> None:
        if num_layers < 1 or max_len < 1:
            raise ValueError(f"StaticKVCache needs num_layers >= 1 and max_len >= 1, got {num_layers}, {max_len}")
        self.num_layers, self.max_len = num_layers, max_len
        # per layer, as HF caches have it (transformers 5.17's mask code scans it for full layers)
        self.is_sliding = [False] * num_layers
        self.buffer: Tensor | None = None  # (L, 2, B, H_kv, max_len, D)
        self.dims: tuple[int, int] | None = None  # (key dim, value dim), each <= D: set with the buffer
        self.slots: Tensor | None = None  # (T,) long: where the next forward writes
        # Eager forwards attend over the first ``window`` slots only (prefix + new tokens), as a
        # growing cache would; None = the whole buffer (a compiled step needs one shape).
        self.window: int | None = None
        self.length = 0  # valid entries: positions [0, length)
        # A hybrid target's recurrent-layer states (conv windows, recurrent matrices), per row: what its
        # linear-attention / Mamba / short-conv layers read and write through the methods below.
        self.states = LinearStates()

    def reset_states(self) -> None:
        """Forget every recurrent state (a new generation's prefill starts from none)."""
        self.states = LinearStates()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.states.get_conv_state(layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self.states.get_recurrent_state(layer_idx, state_idx)

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        return self.states.update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0, **kwargs) -> Tensor:
        return self.states.update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self.states.is_recording_past(layer_idx)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Write key/value (B, H_kv, T, D) at ``slots``; return the layer's full buffers."""
        if self.buffer is None:
            self.dims = (key.shape[-1], value.shape[-1])
            shape = (self.num_layers, 2, *key.shape[:2], self.max_len, max(self.dims))
            self._set_buffer(key.new_zeros(shape))
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.buffer)  # fixed address: CUDA graphs replay on it
        if self.slots is None or self.slots.shape[-1] != key.shape[-2]:
            raise RuntimeError(f"StaticKVCache.slots must name {key.shape[-2]} write positions before the forward")
        if key.shape[:2] != self.buffer.shape[2:4] or (key.shape[-1], value.shape[-1]) != self.dims:
            raise ValueError(
                f"layer {layer_idx} keys have shape {tuple(key.shape)}, values {tuple(value.shape)}; StaticKVCache "
                f"needs every layer to share batch, heads and key/value dims {tuple(self.buffer.shape[2:4])}, "
                f"{self.dims}: targets whose layers differ in KV shape are not supported"
            )
        keys, values = self._layer(layer_idx)  # views: (B, H_kv, M, D), MLA's each its own first dims
        key, value = key.to(keys.dtype), value.to(values.dtype)  # no-ops in the buffer's dtype
        slots = self.slots
        if slots.dim() == 2 and slots.shape[0] == 1:  # one row: its slots are every row's (index_copy_: fewer ops)
            slots = slots[0]
        if slots.dim() == 2:  # (B, T): each row writes at its own slots (a batch of ragged rows)
            index = slots[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[-1])
            keys.scatter_(2, index, key)
            values.scatter_(2, index[..., :1].expand(-1, -1, -1, value.shape[-1]), value)
        else:
            keys.index_copy_(2, slots, key)
            values.index_copy_(2, slots, value)
        if self.window is not None:
            return keys[:, :, : self.window], values[:, :, : self.window]  # views, no copy
        return keys, values

    def _set_buffer(self, buffer: Tensor) -> None:
        """The buffer, and each layer's (keys, values) views of it, made once (a decode step's update of
        every layer then indexes no tensor but its slots: a one-token step is dominated by such small ops)."""
        self.buffer = buffer
        views = [(buffer[i, 0], buffer[i, 1]) for i in range(buffer.shape[0])]
        if self.dims is not None and self.dims[0] != self.dims[1]:  # MLA latents: (B, H_kv, M, D_k or D_v)
            views = [(k[..., : self.dims[0]], v[..., : self.dims[1]]) for k, v in views]
        self._views = views

    def _layer(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Layer ``layer_idx``'s (keys, values) views of the buffer (indexed anew while compiling: a traced step
        reads the static buffer itself)."""
        if torch.compiler.is_compiling():
            keys, values = self.buffer[layer_idx, 0], self.buffer[layer_idx, 1]
            if self.dims[0] != self.dims[1]:
                keys, values = keys[..., : self.dims[0]], values[..., : self.dims[1]]
            return keys, values
        return self._views[layer_idx]

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
            self._set_buffer(bigger)
        self.max_len = max_len

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


def crop_dynamic(cache: DynamicCache, length: int) -> None:
    """Keep a ``DynamicCache``'s first ``length`` positions, in place (sliding-window layers, which drop their
    oldest entries, are refused)."""
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"crop_dynamic crops a DynamicCache, got a {type(cache).__name__}")
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise ValueError("sliding-window cache layers cannot be cropped; build a plain DynamicCache()")
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def buffer_size(needed: int) -> int:
    """Slots to reserve for ``needed``: a power of two >= 256, so a compiled step (whose shapes include
    the buffer's) sees few buffer sizes across calls instead of one per prompt + max_new_tokens. The
    target's static cache and the heads' caches both size with it."""
    return max(256, 1 << (max(1, int(needed)) - 1).bit_length())


class StaticHeadCache:
    """A draft head's KV cache for inference: per-layer (rows, H_kv, capacity, D) buffers written in
    place, each row (a batch's row) at its own length.

    Two ways in:
    - batched (``update`` with ``rows`` keys): one head forward for every row; row b writes its T
      entries at its own slots ``length_b``.. and ``counts`` (set by the caller, None = T each) says
      how many of them it keeps (a row with fewer real entries pads: the padding lands past its
      length, where nothing is read and the next write overwrites it). ``update`` returns the buffers
      up to ``max_b length_b + T``: the caller's additive mask (``causal_mask``) hides each row's
      slots past its own entries (``block_mask``: each row's own prefix and a block of explored
      entries, for EAGLE-2's tree levels);
    - one row (``row(b)``, with ``HeadCache``'s interface): ``update`` appends to that row and returns
      views of its valid entries (any one-row user). ``rows == 1``: the
      cache itself behaves as its one row.

    ``capacity`` is reserved up front (prompt + max_new_tokens + what one draft explores), so a
    generation neither allocates nor concatenates per step; past it the buffers double (a rare
    reallocation, never wrong). Not for training: in-place writes would break autograd, which is
    why training keeps ``heads.layers.HeadCache``.
    """

    def __init__(self, capacity: int = 256, rows: int = 1) -> None:
        if rows < 1:
            raise ValueError(f"StaticHeadCache needs rows >= 1, got {rows}")
        self.capacity = max(1, int(capacity))
        self.rows = int(rows)
        self._keys: list[Tensor] = []  # per layer (rows, H_kv, capacity, D)
        self._values: list[Tensor] = []
        self._lengths: list[list[int]] = []  # per layer, per row (host ints)
        self.counts: list[int] | None = None  # entries each row keeps from the next batched forward

    # --------------------------------------------------------------------------- batched

    def row_lengths(self) -> list[int]:
        """Each row's valid entries (the first layer's; every layer agrees between forwards)."""
        return list(self._lengths[0]) if self._lengths else [0] * self.rows

    def layer_lengths(self, layer_idx: int) -> list[int]:
        """Each row's entries in layer ``layer_idx`` (a head whose layers run at different draft levels, as an
        MTP block of several layers does, has them differ within a draft)."""
        return list(self._lengths[layer_idx]) if layer_idx < len(self._lengths) else [0] * self.rows

    def _allocate(self, layer_idx: int, key: Tensor, value: Tensor) -> None:
        if layer_idx != len(self._keys):
            raise RuntimeError(f"StaticHeadCache: layer {layer_idx} written before layer {len(self._keys)}")
        self._keys.append(key.new_zeros(self.rows, key.shape[1], self.capacity, key.shape[-1]))
        self._values.append(value.new_zeros(self.rows, value.shape[1], self.capacity, value.shape[-1]))
        self._lengths.append([0] * self.rows)

    def update(self, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write key/value (rows, H_kv, T, D) at each row's own length; return the layer's buffers
        (rows, H_kv, max_b length_b + T, D)."""
        if key.shape[0] != self.rows:
            raise ValueError(f"StaticHeadCache of {self.rows} rows got keys for {key.shape[0]}")
        if layer_idx == len(self._keys):
            self._allocate(layer_idx, key, value)
        lengths, t = self._lengths[layer_idx], key.shape[2]
        end = max(lengths) + t
        self._ensure(end)
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        if min(lengths) == max(lengths):  # every row at the same length: one slice write
            keys[:, :, lengths[0]: end] = key
            values[:, :, lengths[0]: end] = value
        else:
            slots = torch.tensor(lengths, device=key.device)[:, None] + torch.arange(t, device=key.device)  # (rows, T)
            scatter_slots(keys, slots, key)
            scatter_slots(values, slots, value)
        counts = self.counts if self.counts is not None else [t] * self.rows
        self._lengths[layer_idx] = [n + c for n, c in zip(lengths, counts)]
        return keys[:, :, :end], values[:, :, :end]

    def causal_mask(self, t: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """Additive (rows, 1, T, max_b length_b + T) mask of a batched forward of T entries per row:
        row b's query i sees its valid entries and its own first i + 1 new ones."""
        lengths = torch.tensor(self.row_lengths(), device=device)  # (rows,)
        col = torch.arange(max(self.row_lengths()) + t, device=device)  # (W,)
        last = lengths[:, None] + torch.arange(t, device=device)[None]  # (rows, T) each query's own slot
        return additive_mask(col[None, None, :] <= last[:, :, None], dtype)[0, 0][:, None]

    def block_mask(self, prefixes: list[int], block: Tensor, dtype: torch.dtype) -> Tensor:
        """Additive (rows, 1, Q, max_b length_b + Q) mask of a batched forward of Q entries per row
        after each row's ``prefixes[b]`` accepted entries and its explored ones: row b's queries see
        its prefix, then ``block[b]`` (Q, K) bool over its slots ``prefixes[b]``.. (its explored
        entries and the Q new ones, K = explored + Q), nothing else (EAGLE-2's tree levels)."""
        q, k = block.shape[-2:]
        width = max(self.row_lengths()) + q
        if min(prefixes) == max(prefixes):  # every row at one prefix (one row): plain concatenation
            allowed = torch.cat([block.new_ones(self.rows, q, prefixes[0]), block,
                                 block.new_zeros(self.rows, q, width - prefixes[0] - k)], dim=2)
            return additive_mask(allowed, dtype)[0, 0][:, None]
        return block_slot_mask(torch.tensor(prefixes, device=block.device), block, width, dtype)

    def crop_rows(self, lengths: list[int]) -> None:
        """Row b keeps its first ``lengths[b]`` entries (the rest is left and later overwritten)."""
        self._lengths = [[min(n, m) for n, m in zip(layer, lengths)] for layer in self._lengths]

    def crop_row(self, b: int, length: int) -> None:
        """Row ``b`` keeps its first ``length`` entries; the other rows keep theirs."""
        lengths = self.row_lengths()
        lengths[b] = length
        self.crop_rows(lengths)

    def buffers(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer the whole (rows, H_kv, capacity, D) keys and values: fixed shapes for a compiled
        reader, whose mask hides each row's slots past its own length."""
        return list(zip(self._keys, self._values))

    def context(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer (keys, values) (rows, H_kv, max_b length_b, D): every row's entries, a row's
        slots past its own length hidden by the caller's mask."""
        end = max(self.row_lengths())
        return [(k[:, :, :end], v[:, :, :end]) for k, v in zip(self._keys, self._values)]

    def make_room(self, needed: int) -> None:
        """Room for ``needed`` entries per row (buffers double past the capacity)."""
        if self._keys:
            self._ensure(needed)

    def _ensure(self, needed: int) -> None:
        size = self.capacity
        while size < needed:
            size *= 2
        if size == self.capacity:
            return
        for store in (self._keys, self._values):
            for i, old in enumerate(store):
                store[i] = torch.cat([old, old.new_zeros(*old.shape[:2], size - old.shape[2], old.shape[3])], dim=2)
        self.capacity = size

    # --------------------------------------------------------------------------- one row

    def row(self, b: int) -> "HeadCacheRow":
        """Row ``b`` with ``HeadCache``'s interface."""
        if not 0 <= b < self.rows:
            raise IndexError(f"row {b} of a {self.rows}-row StaticHeadCache")
        return HeadCacheRow(self, b)

    def _update_row(self, b: int, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if layer_idx == len(self._keys):
            self._allocate(layer_idx, key, value)
        start = self._lengths[layer_idx][b]
        end = start + key.shape[2]
        self._ensure(end)
        self._keys[layer_idx][b: b + 1, :, start:end] = key
        self._values[layer_idx][b: b + 1, :, start:end] = value
        self._lengths[layer_idx][b] = end
        return self._keys[layer_idx][b: b + 1, :, :end], self._values[layer_idx][b: b + 1, :, :end]

    def _one_row(self) -> None:
        if self.rows != 1:
            raise ValueError(f"a {self.rows}-row StaticHeadCache: use row(b) for one row's entries")

    @property
    def keys(self) -> list[Tensor]:
        self._one_row()
        return self.row(0).keys

    @property
    def values(self) -> list[Tensor]:
        self._one_row()
        return self.row(0).values

    def get_seq_length(self) -> int:
        self._one_row()
        return self.row(0).get_seq_length()

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (entries past them are left and later overwritten)."""
        self._one_row()
        self.row(0).crop(length)


class SlotWrites:
    """A ``StaticHeadCache``'s buffers seen whole, for fixed-shape (compiled) head forwards: ``update``
    writes row b's T new entries at the device slots ``slots[b]`` and returns every layer's full
    (rows, H_kv, capacity, D) buffers, so a forward's shapes never change with the rows' lengths and a
    CUDA graph can replay it; the caller's mask hides each row's slots past its own entries. The
    owner's (host) lengths are not advanced: what is written here is exploration, overwritten later.
    Every layer must exist already (the cache has observed tokens) and the slots lie within capacity."""

    def __init__(self, cache: StaticHeadCache, slots: Tensor) -> None:
        self.cache, self.slots = cache, slots  # slots (rows, T) long

    def update(self, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache._keys[layer_idx], self.cache._values[layer_idx]
        scatter_slots(keys, self.slots, key)
        scatter_slots(values, self.slots, value)
        return keys, values


def scatter_slots(buffer: Tensor, slots: Tensor, entries: Tensor) -> None:
    """Write ``entries`` (rows, H, T, D) into ``buffer`` (rows, H, capacity, D) at each row's ``slots`` (rows, T);
    keys and values each by their own width (multi-head latent attention caches latents of two widths)."""
    index = slots[:, None, :, None].expand(-1, entries.shape[1], -1, entries.shape[-1])
    buffer.scatter_(2, index, entries.to(buffer.dtype))


def block_slot_mask(prefixes: Tensor, block: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """Additive (rows, 1, Q, width) mask of Q new entries per row after row b's ``prefixes[b]`` (a
    device tensor) accepted entries: row b's queries see its prefix, then ``block[b]`` (Q, K) bool over
    its slots prefixes[b].. (explored entries and the Q new ones), nothing else."""
    q, k = block.shape[-2:]
    rel = torch.arange(width, device=block.device)[None, :] - prefixes[:, None]  # (rows, W) slot past each prefix
    seen = block.gather(2, rel.clamp(0, k - 1)[:, None, :].expand(-1, q, -1))  # (rows, Q, W)
    allowed = (rel < 0)[:, None, :] | (seen & (rel < k)[:, None, :])
    return additive_mask(allowed, dtype)[0, 0][:, None]


def slot_mask(slots: Tensor, capacity: int, dtype: torch.dtype) -> Tensor:
    """Additive (rows, 1, 1, capacity) mask of one new entry per row at ``slots`` (rows, 1): row b sees
    its slots 0..slots[b] (its entries, then itself) and nothing after (stale exploration)."""
    columns = torch.arange(capacity, device=slots.device)
    mask = torch.zeros(slots.shape[0], capacity, dtype=dtype, device=slots.device)
    return mask.masked_fill(columns[None] > slots, torch.finfo(dtype).min)[:, None, None]


class HeadCacheRow:
    """One row of a ``StaticHeadCache`` with ``HeadCache``'s interface (views of that row's entries)."""

    def __init__(self, cache: StaticHeadCache, b: int) -> None:
        self.cache, self.b = cache, b

    def update(self, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache._update_row(self.b, layer_idx, key, value)

    @property
    def keys(self) -> list[Tensor]:
        return [k[self.b: self.b + 1, :, :n[self.b]] for k, n in zip(self.cache._keys, self.cache._lengths)]

    @property
    def values(self) -> list[Tensor]:
        return [v[self.b: self.b + 1, :, :n[self.b]] for v, n in zip(self.cache._values, self.cache._lengths)]

    def get_seq_length(self) -> int:
        return self.cache._lengths[0][self.b] if self.cache._lengths else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (entries past them are left and later overwritten)."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        for lengths in self.cache._lengths:
            lengths[self.b] = min(lengths[self.b], length)
