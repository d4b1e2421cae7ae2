"""The MTP head's drafter: EAGLE-1's draft loop (``infer.drafters.eagle``) over the target's own MTP block.

The block reads the target's final post-norm state at the last accepted token and the root's embedding, and
its post-norm output goes both to the target's lm_head (the draft's law) and back into the block for the
next level: a chain of k drafts reuses a one-layer block k times; an EAGLE-2 dynamic tree expands it level by
level the same way.

A block of n > 1 layers drafts level s with layer s mod n (vLLM's ``spec_step_idx % num_mtp_layers``,
docs/mtp.md): every layer reads the accepted tokens (the target's states, the same slots and positions), and
at a draft level the chosen layer attends to those and to the levels it drafted itself (its own cache
entries, at their true positions). Such a block drafts chains, eagerly (``compile_with`` keeps it eager).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.heads.layers import additive_mask
from draftsmith.infer.cache import StaticHeadCache
from draftsmith.infer.drafters.base import Chain
from draftsmith.infer.drafters.eagle import EagleDrafter
from draftsmith.target.lean_mtp import lean_mtp_layers


class MtpDrafter(EagleDrafter):
    gpu_depth = 6

    def __init__(self, head: nn.Module, target: nn.Module, tree, confidence: float | None = None) -> None:
        self.num_layers = head.config.num_mtp_layers or 1
        if self.num_layers > 1 and not isinstance(tree, Chain):
            raise ValueError(f"an MTP head of {self.num_layers} layers drafts chains (level s uses layer s mod "
                             f"{self.num_layers}), not a {type(tree).__name__}: pass a chain")
        super().__init__(head, target, tree, confidence)
        self._lean: list | None = None  # eager: the layers as target.lean_mtp runs them, built at each decode
        self._compiled = False
        self._layer = 0  # the MTP layer the next head step runs
        self._level: int | None = None  # the draft level of the next step (None: observing accepted tokens)
        self._start: Tensor | None = None  # (rows,) each row's accepted entries when its chain began

    def compile_with(self, compile: bool | str) -> None:
        self._compiled = bool(compile if self.num_layers == 1 else False)
        super().compile_with(compile if self.num_layers == 1 else False)

    def begin(self, sampling, rows: int = 1) -> None:
        super().begin(sampling, rows)
        head = self.head
        self._lean = None if self._compiled else lean_mtp_layers(head.layers, head.rotary_emb, head.rope_types)

    def _step(self, cache, hidden: Tensor, tokens: Tensor, position: Tensor, mask: Tensor | None) -> Tensor:
        run = None if self._lean is None else self._lean[self._layer]
        return self.head(hidden_states=hidden, inputs_embeds=self.embed(tokens), position_ids=position,
                         attention_mask=mask, past_key_values=cache, layer=self._layer, run=run).hidden_states

    def _batched_step(self, cache: StaticHeadCache, hidden: Tensor, tokens: Tensor,
                      counts: list[int] | None = None) -> Tensor:
        if self.num_layers == 1:
            return super()._batched_step(cache, hidden, tokens, counts)
        if self._level is None:  # accepted tokens: every layer reads them; layer 0 drafts the next level
            t = tokens.shape[1]
            position = torch.tensor(cache.row_lengths(), device=tokens.device)[:, None] + torch.arange(
                t, device=tokens.device)[None]
            mask = cache.causal_mask(t, hidden.dtype, tokens.device)
            outs = []
            for layer in range(self.num_layers):
                self._layer, cache.counts = layer, counts
                try:
                    outs.append(self._step(cache, hidden, tokens, position, mask))
                finally:
                    self._layer, cache.counts = 0, None
            return outs[0]
        self._level += 1
        self._layer = self._level % self.num_layers
        own = torch.tensor(cache.layer_lengths(self._layer), device=tokens.device)  # (rows,) its entries
        width = int(own.max()) + 1
        mask = additive_mask(torch.arange(width, device=tokens.device)[None, None] <= own[:, None, None],
                             hidden.dtype)[0, 0][:, None]
        try:
            return self._step(cache, hidden, tokens, (self._start + self._level - 1)[:, None], mask)
        finally:
            self._layer = 0

    def _chains(self, cache, states, roots, lengths, sampling):
        if self.num_layers == 1:
            return super()._chains(cache, states, roots, lengths, sampling)
        self._level, self._start = 0, torch.tensor(cache.row_lengths(), device=self.embed.weight.device)
        try:
            return super()._chains(cache, states, roots, lengths, sampling)
        finally:
            self._level = self._start = None


DRAFTER = MtpDrafter
