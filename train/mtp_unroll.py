"""Training-time test for an MTP block of n layers: step k runs layer k mod n, as the drafter's level k does
(``infer.drafters.mtp``). Every layer reads step 0's inputs (the target's states and the next tokens: the
drafter's accepted context); step k's layer attends to those (causal) and to its own earlier steps at the same
position (EAGLE's diagonal blocks). A one-layer block is ``train.unroll.unroll`` itself."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from draftsmith.heads import HeadCache
from draftsmith.train.unroll import shift_left, ttt_attention_mask, unroll


def mtp_unroll(head: nn.Module, hidden: Tensor, embeds: Tensor, steps: int) -> Iterator[Tensor]:
    """Each step's output (B, T, H); step k at position i reads token i+1+k and step k-1's output."""
    n = head.config.num_mtp_layers or 1
    if n == 1:
        yield from unroll(head, hidden, embeds, steps)
        return
    batch, seq_len, _ = hidden.shape
    cache = HeadCache()
    positions = torch.arange(seq_len, device=hidden.device).expand(batch, seq_len)
    first, causal = shift_left(embeds, 1), ttt_attention_mask(seq_len, 0, hidden.dtype, hidden.device)
    outs = [head(hidden_states=hidden, inputs_embeds=first, position_ids=positions, past_key_values=cache,
                 attention_mask=causal.expand(batch, -1, -1, -1), layer=j).hidden_states for j in range(n)]  # every layer's context; layer 0 drafts step 0
    hidden, own = outs[0], [0] * n  # own[j]: steps past 0 that layer j's cache holds
    yield hidden
    for k in range(1, steps):
        j = k % n
        own[j] += 1
        mask = ttt_attention_mask(seq_len, own[j], hidden.dtype, hidden.device).expand(batch, -1, -1, -1)
        hidden = head(hidden_states=hidden, inputs_embeds=shift_left(embeds, 1 + k), position_ids=positions + k,
                      attention_mask=mask, past_key_values=cache, layer=j).hidden_states
        yield hidden
