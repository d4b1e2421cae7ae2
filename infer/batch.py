"""Batched greedy speculative decoding (issue 18, first cut): B left-padded prompts, one target
forward per step for all rows, each row advancing by its own accepted length.

Layout: one KV buffer per layer, (B, H_kv, M, D), M = P + max_new_tokens + 1 + draft length. Column
j of every row is the same cache slot; the prompt fills columns [0, P) (left padding masked), and
row b's accepted tokens follow it at [P, L_b), L_b its own length. A step writes row b's chain
(root + up to ``length`` n-gram drafts, padded to the step's common N) at [L_b, L_b + N): chain
acceptance keeps a prefix of the chain, which already sits where it belongs, so nothing is
compacted; rejected and padded entries lie past the new L_b, masked, and are overwritten next step.
The additive mask (B, 1, N, M) lets query t of row b see its row's non-padding columns up to
L_b + t; positions are ``attention_mask.cumsum(-1) - 1`` for the prompt and L_b - pads_b + t after.
Finished rows still ride along (fixed shapes) but write at a clamped start and are never read.

Greedy only, n-gram drafter only (chains: ``branches=1``); heads, draft models and sampling are
refused in one line. The target runs eagerly (``compile`` is not applied to the batched step).
"""
from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from infer.drafters import Sampling
from infer.ngram import NgramDrafter, find_continuations
from infer.target import backbone_of, causal_lm_of, decoder_layers


class BatchKVCache:
    """Per-layer (B, H_kv, M, D) key/value buffers; each forward writes its (B, T) ``slots`` (one
    start per row) and attends over the whole buffer (the caller's 4D mask hides what is not valid).
    Follows the part of HF's cache interface that decoder layers call (``update``)."""

    is_compileable = False

    def __init__(self, num_layers: int, max_len: int) -> None:
        self.num_layers, self.max_len = num_layers, max_len
        self.is_sliding = [False] * num_layers
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers
        self.slots: Tensor | None = None  # (B, T) long

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.keys[layer_idx] is None:
            self.keys[layer_idx] = key.new_zeros(*key.shape[:2], self.max_len, key.shape[-1])
            self.values[layer_idx] = value.new_zeros(*value.shape[:2], self.max_len, value.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        index = self.slots[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[-1])  # (B, H, T, D)
        keys.scatter_(2, index, key.to(keys.dtype))
        values.scatter_(2, index, value.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and masks are always given explicitly


def _forward(target: Any, cache: BatchKVCache, tokens: Tensor, slots: Tensor, positions: Tensor,
             allowed: Tensor) -> Tensor:
    """One target forward over (B, T) ``tokens`` written at ``slots``; ``allowed`` (B, T, M) bool.
    Returns logits (B, T, V)."""
    cache.slots = slots
    dtype = target.get_input_embeddings().weight.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    out = backbone_of(target)(input_ids=tokens, attention_mask=mask[:, None], position_ids=positions,
                              past_key_values=cache, use_cache=True)
    return causal_lm_of(target).get_output_embeddings()(out.last_hidden_state)


def _check_batch(gen: Any, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int) -> Tensor:
    """Refuse what this path cannot do; returns the per-row real prompt lengths (B,)."""
    if not isinstance(gen.drafter, NgramDrafter):
        raise ValueError(f"batched decoding supports NgramDrafter only for now, got {type(gen.drafter).__name__}")
    if gen.drafter.branches != 1:
        raise ValueError(f"batched decoding drafts chains only: NgramDrafter branches must be 1, "
                         f"got {gen.drafter.branches}")
    if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise ValueError("input_ids must be a LongTensor of shape (batch, prompt_len)")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must hold at least one row and one token, got shape {tuple(input_ids.shape)}")
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {shape}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 and 1")
    mask = attention_mask.to(torch.long)
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("attention_mask must be left-padded (zeros, then ones in every row); pad on the left")
    lengths = mask.sum(-1)
    if int(lengths.min()) == 0:
        raise ValueError(f"row {int((lengths == 0).nonzero()[0, 0])} of the batch is all padding: pass at least one token")
    vocab = gen.target.config.get_text_config().vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids contain ids outside the target's vocabulary [0, {vocab})")
    for row, n in enumerate(lengths.tolist()):  # context and sliding window, on each row's real length
        gen._check(input_ids[row:row + 1, input_ids.shape[1] - n:], max_new_tokens, Sampling())
    return lengths


def _pad_id(gen: Any, eos: list[int]) -> int:
    """The id filling each row after its EOS or budget: the target's pad id, else its first EOS."""
    pad = getattr(getattr(gen.target, "generation_config", None), "pad_token_id", None)
    if pad is None:
        pad = getattr(gen.target.config.get_text_config(), "pad_token_id", None)
    if pad is None and eos:
        pad = eos[0]
    if pad is None:
        raise ValueError("batched decoding pads finished rows: the target has no pad_token_id and no eos_token_id")
    return int(pad[0] if isinstance(pad, (list, tuple)) else pad)


@torch.inference_mode()
def generate_batch(gen: Any, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int,
                   eos_token_id: int | list[int] | None = None) -> Tensor:
    """Greedy speculative decoding of a left-padded batch with ``gen``'s target and n-gram drafter.

    Returns (B, prompt_len + max_new_tokens) on ``input_ids``' device: the prompts as given, then
    each row's new tokens (those ``target.generate`` gives that row alone), the pad id after its
    EOS or budget. Fills ``gen.last_stats`` (``steps`` counts row-steps, ``target_forwards`` forwards)."""
    start_time = time.perf_counter()
    lengths = _check_batch(gen, input_ids, attention_mask, max_new_tokens)
    eos_list = gen._eos_ids(eos_token_id).tolist()
    pad_id = _pad_id(gen, eos_list)
    device, drafter = gen.device, gen.drafter
    ids, mask = input_ids.to(device), attention_mask.to(device).bool()
    batch, prompt = ids.shape
    lengths = lengths.to(device)
    pads = prompt - lengths  # (B,) left padding per row
    max_len = prompt + max_new_tokens + 1 + drafter.length
    cache = BatchKVCache(len(decoder_layers(gen.target)), max_len)
    col = torch.arange(max_len, device=device)
    key_ok = torch.ones(batch, max_len, dtype=torch.bool, device=device)
    key_ok[:, :prompt] = mask  # padding columns are never attended (but by the pad queries themselves)
    stats = type(gen.last_stats)()  # the generator's GenerationStats, without importing the generator

    # Prefill: (B, P) at columns [0, P); a padding query sees itself only (no all-masked row).
    slots = torch.arange(prompt, device=device).expand(batch, -1)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    rows = torch.arange(prompt, device=device)[:, None]
    allowed = (key_ok[:, None, :] & (col[None, None] <= rows[None])) | (col[None, None] == rows[None])
    logits = _forward(gen.target, cache, ids, slots, positions, allowed)
    stats.target_forwards += 1
    roots = logits[:, -1].float().argmax(-1).tolist()

    emitted: list[list[int]] = [[] for _ in range(batch)]
    done = [False] * batch
    history = [ids[b, int(pads[b]):].tolist() for b in range(batch)]  # the n-gram drafter's text, per row
    for b in range(batch):
        done[b] = _emit(emitted[b], history[b], [roots[b]], eos_list, max_new_tokens)
    filled = torch.full((batch,), prompt, dtype=torch.long, device=device)  # L_b: valid columns per row

    while not all(done):
        drafts = []
        for b in range(batch):
            if done[b]:
                drafts.append([])
                continue
            depth = min(drafter.length, max_new_tokens - len(emitted[b]) - 1)
            found = find_continuations(torch.tensor(history[b]), drafter.max_ngram, drafter.min_ngram, depth, 1) \
                if depth > 0 else []
            drafts.append(found[0].tolist() if found else [])
        width = 1 + max(len(d) for d in drafts)  # N: the step's common chain length
        tokens = torch.full((batch, width), pad_id, dtype=torch.long)
        for b in range(batch):
            if not done[b]:
                tokens[b, 0] = emitted[b][-1]
                tokens[b, 1:1 + len(drafts[b])] = torch.tensor(drafts[b], dtype=torch.long)
        tokens = tokens.to(device)
        active = torch.tensor([not d for d in done], device=device)
        start = torch.where(active, filled, filled.clamp(max=max_len - width))  # (B,) finished rows: any room
        offsets = torch.arange(width, device=device)
        slots = start[:, None] + offsets  # (B, N)
        positions = (start - pads)[:, None] + offsets
        allowed = key_ok[:, None, :] & (col[None, None] <= slots[:, :, None])  # chain causal over the prefix
        logits = _forward(gen.target, cache, tokens, slots, positions, allowed)
        stats.target_forwards += 1
        stats.steps += int(active.sum())  # row-steps: tau is the mean tokens a row gains per step
        stats.verified_tokens += batch * width
        pred = logits.float().argmax(-1).tolist()  # (B, N) the target's greedy token after each node
        for b in range(batch):
            if done[b]:
                continue
            accepted = 0
            while accepted < len(drafts[b]) and drafts[b][accepted] == pred[b][accepted]:
                accepted += 1
            new = drafts[b][:accepted] + [pred[b][accepted]]
            before = len(emitted[b])
            done[b] = _emit(emitted[b], history[b], new, eos_list, max_new_tokens)
            stats.step_tokens += len(emitted[b]) - before
            filled[b] += 1 + accepted  # root + accepted drafts now hold valid KV; the bonus is the next root

    out = torch.full((batch, prompt + max_new_tokens), pad_id, dtype=torch.long)
    out[:, :prompt] = input_ids.cpu()
    for b in range(batch):
        out[b, prompt:prompt + len(emitted[b])] = torch.tensor(emitted[b], dtype=torch.long)
    stats.new_tokens = sum(len(e) for e in emitted)
    stats.wall_time = time.perf_counter() - start_time
    gen.last_stats = stats
    return out.to(input_ids.device)


def _emit(emitted: list[int], history: list[int], new: list[int], eos: list[int], max_new: int) -> bool:
    """Append ``new`` cut after its first EOS and to the budget; returns whether the row is done."""
    kept = new[: max_new - len(emitted)]
    stop = len(emitted) + len(kept) >= max_new
    for i, tok in enumerate(kept):
        if tok in eos:
            kept, stop = kept[: i + 1], True
            break
    emitted.extend(kept)
    history.extend(kept)
    return stop
