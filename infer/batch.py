"""Batch speculation: a left-padded batch of B prompts decoded together, each row lossless on its own.

Per-row state on fixed shapes (the vLLM/SGLang way):
- the target's ``StaticKVCache`` holds (B, ..., max_len) slots; the prompt fills slots [0, P) of every
  row (left padding first), and row b's accepted tokens follow at its own length ``lengths[b]``;
- positions come from ``attention_mask.cumsum - 1`` for the prompt and from each row's own counter
  after it (``lengths - pads``);
- one [B, N] verify per step: every row's draft padded to the step's N nodes with dummy nodes no real
  node sees (``infer.tree.pad_tree``), written at the row's own slots (a scatter), under a per-row
  additive mask (the row's left-pad columns blocked, its valid prefix visible, its tree after it);
- each row accepts on its own (the same acceptance rules as batch size 1), advances by its own
  accepted length, stops at its own EOS or budget; a finished row verifies its last token alone as
  a masked no-op (its writes land past its length, its outputs are never read);
- accepted paths are compacted for every row at once (``StaticKVCache.compact_rows``, one
  fixed-size gather); rejected slots are simply overwritten by the next verify.

Drafters keep their batch-size-1 interface: each row has its own drafter state and drafts on its
own (n-gram, heads, draft LM alike); only the target, where the time goes, runs batched.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from heads.layers import additive_mask
from infer.cache import StaticKVCache
from infer.drafters import Draft, Sampling, root_only
from infer.target import TargetOutput, _backbone, _causal_lm
from infer.tree import pad_tree


def masked_forward(model: nn.Module, input_ids: Tensor, slots: Tensor, mask: Tensor, positions: Tensor,
                   cache: StaticKVCache, aux_layer_ids: tuple[int, ...] = ()) -> TargetOutput:
    """One target forward over ``cache`` for a batch: input_ids (B, T) written at ``slots`` ((T,)
    shared, or (B, T) per row), under the additive ``mask`` (B, 1, T, cache.attended) at
    ``positions`` (B, T)."""
    cache.slots = slots
    out = _backbone(model)(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True, output_hidden_states=bool(aux_layer_ids))
    final_hidden = out.last_hidden_state
    aux = torch.cat([out.hidden_states[k] for k in aux_layer_ids], dim=-1) if aux_layer_ids else None
    logits = _causal_lm(model).get_output_embeddings()(final_hidden)
    return TargetOutput(logits=logits, final_hidden=final_hidden, aux_hidden=aux, past_key_values=cache)


def prefill_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, 1, P, P) additive mask of a left-padded prompt: causal over each row's real tokens; a pad
    query sees itself only (its output is never read)."""
    p = attention_mask.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool, device=attention_mask.device).tril_()
    allowed = (causal[None] & attention_mask.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool,
                                                                              device=attention_mask.device)
    return additive_mask(allowed, dtype)[0, 0][:, None]


def verify_mask(lengths: Tensor, pads: Tensor, blocks: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """(B, 1, N, width) additive mask of a [B, N] verify: row b's queries see its slots [pads[b],
    lengths[b]) and, among the N slots written at lengths[b], those ``blocks[b]`` (N, N) allows."""
    n = blocks.shape[-1]
    col = torch.arange(width, device=lengths.device)[None]  # (1, W)
    rel = col - lengths[:, None]  # (B, W) slot relative to the row's first new slot
    prefix = (col >= pads[:, None]) & (rel < 0)  # (B, W)
    inside = (rel >= 0) & (rel < n)
    tree = blocks.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(-1, n, -1)) & inside[:, None, :]  # (B, N, W)
    return additive_mask(prefix[:, None, :] | tree, dtype)[0, 0][:, None]


def generate_batch(gen: Any, ids: Tensor, attention_mask: Tensor, max_new_tokens: int,
                   sampling: Sampling, eos: Tensor, pad_token_id: int, stats: Any) -> Tensor:
    """Speculative decoding of a left-padded batch ``ids`` (B, P) with ``attention_mask`` (B, P) on
    ``gen``'s (an ``infer.generator.SpeculativeGenerator``, which calls this) target and drafter,
    counting into ``stats`` (its ``GenerationStats``); returns (B, P + the longest row's new tokens), each row padded
    with ``pad_token_id`` after its own end, as HF's batched ``generate``."""
    target, drafter, device = gen.target, gen.drafter, gen.device
    bsz, plen = ids.shape
    aux_ids = drafter.aux_layer_ids
    pads = (attention_mask == 0).sum(dim=1)  # (B,) left-pad columns per row
    cache = gen._reserve_static_cache(plen + max_new_tokens + (gen.budget or 1), bsz)
    cache.window = plen
    positions = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    out = masked_forward(target, ids, torch.arange(plen, device=device), prefill_mask(attention_mask, gen.dtype),
                         positions, cache, aux_ids)
    stats.target_forwards += 1
    features = out.aux_hidden if aux_ids else out.final_hidden

    lengths = torch.full((bsz,), plen, dtype=torch.long, device=device)  # valid slots per row
    states, roots, emitted, done = [], [], [[] for _ in range(bsz)], [False] * bsz
    for b in range(bsz):
        pad = int(pads[b])  # sync
        first = gen._next_token(out.logits[b, -1], sampling)
        state = drafter.new_state()
        drafter.reserve(state, plen - pad + max_new_tokens)
        drafter.begin(state, ids[b: b + 1, pad:])
        kept, done[b] = gen._trim(first.reshape(1), eos, max_new_tokens)
        emitted[b].append(kept)
        if not done[b]:
            drafter.observe(state, features[b: b + 1, pad:], torch.cat([ids[b, pad + 1:], kept])[None])
        states.append(state)
        roots.append(first)

    while not all(done):
        drafts: list[Draft] = []
        for b in range(bsz):
            if done[b]:
                drafts.append(root_only(roots[b]))  # a masked no-op: never read
                continue
            remaining = max_new_tokens - sum(t.numel() for t in emitted[b])
            drafts.append(drafter.propose(states[b], roots[b], sampling, max_depth=remaining - 1))
        n = max(d.tokens.shape[0] for d in drafts)
        padded = [pad_tree(d.tokens, d.tree.depths, d.tree.mask, n) for d in drafts]
        tokens = torch.stack([p[0] for p in padded])  # (B, N)
        depths = torch.stack([p[1] for p in padded])
        blocks = torch.stack([p[2] for p in padded])  # (B, N, N)
        width = int(lengths.max()) + n  # sync: eager attends over the used slots only
        cache.grow(width)
        cache.window = width
        slots = lengths[:, None] + torch.arange(n, device=device)[None]
        mask = verify_mask(lengths, pads, blocks, width, gen.dtype)
        out = masked_forward(target, tokens, slots, mask, (lengths - pads)[:, None] + depths, cache, aux_ids)
        features = out.aux_hidden if aux_ids else out.final_hidden
        stats.target_forwards += 1
        stats.steps += 1
        stats.verified_tokens += bsz * n
        nodes = torch.full((bsz, n), -1, dtype=torch.long, device=device)
        accepted_len = torch.zeros(bsz, dtype=torch.long, device=device)
        for b in range(bsz):
            if done[b]:
                continue
            draft = drafts[b]
            k = draft.tokens.shape[0]
            accepted = gen._accept(out.logits[b, :k], draft, sampling)
            row = accepted.nodes[0, : int(accepted.length[0])]  # sync: (A,) root first
            new = torch.cat([draft.tokens[row[1:]], accepted.bonus])
            nodes[b, : row.numel()] = row
            accepted_len[b] = row.numel()
            remaining = max_new_tokens - sum(t.numel() for t in emitted[b])
            kept, done[b] = gen._trim(new, eos, remaining)
            stats.step_tokens += kept.numel()
            emitted[b].append(kept)
            if not done[b]:
                drafter.observe(states[b], features[b: b + 1, row], new[None])
                roots[b] = new[-1]
        cache.compact_rows(lengths, nodes[:, : int(accepted_len.max())])
        lengths += accepted_len

    rows = [torch.cat(chunks) for chunks in emitted]
    stats.new_tokens = sum(r.numel() for r in rows)
    width = max(r.numel() for r in rows)
    new = torch.full((bsz, width), pad_token_id, dtype=ids.dtype, device=device)
    for b, r in enumerate(rows):
        new[b, : r.numel()] = r
    return torch.cat([ids, new], dim=1)


__all__ = ["generate_batch", "masked_forward", "prefill_mask", "verify_mask"]
