"""EAGLE's training-time test: draft several steps in parallel over every position of a sequence."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from draftsmith.heads import HeadCache
from draftsmith.heads.layers import additive_mask


def shift_left(x: Tensor, n: int) -> Tensor:
    """x (B, T, ...) shifted ``n`` positions to the left along T, zero-filled at the end."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])], dim=1)


def ttt_attention_mask(seq_len: int, step: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive (1, 1, T, (step+1)·T) mask ``[causal | diag | ... | diag]`` of training-time test:
    the query at t sees step 0's keys <= t and, of steps 1..step, only position t."""
    idx = torch.arange(seq_len, device=device)
    causal = idx[None, :] <= idx[:, None]  # (T, T)
    diag = idx[None, :] == idx[:, None]
    allowed = torch.cat([causal] + [diag] * step, dim=1)  # (T, (step+1)T)
    return additive_mask(allowed, dtype)


def unroll(head: nn.Module, hidden: Tensor, embeds: Tensor, steps: int,
           drafted: Callable[[int, Tensor], Tensor] | None = None) -> Iterator[Tensor]:
    """Draft ``steps`` steps in parallel over all positions (EAGLE training-time test).

    Step k at position i reads token i+1+k (teacher-forced) and step k-1's un-normed output,
    at RoPE position i+k; yields each step's output (B, T, H). ``drafted(k, previous output)``: the
    embeddings (B, T, H) step k >= 1 reads instead, those of the token step k-1 drafted at the same
    position (the on-policy stage: the head's own context, not the data's).
    """
    batch, seq_len, _ = hidden.shape
    cache = HeadCache()
    for k in range(steps):
        positions = (torch.arange(seq_len, device=hidden.device) + k).expand(batch, seq_len)
        mask = None if k == 0 else ttt_attention_mask(seq_len, k, hidden.dtype, hidden.device).expand(batch, -1, -1, -1)
        inputs = shift_left(embeds, 1 + k) if drafted is None or k == 0 else drafted(k, hidden)
        hidden = head(hidden_states=hidden, inputs_embeds=inputs, position_ids=positions,
                      attention_mask=mask, past_key_values=cache).hidden_states
        yield hidden
