"""P-EAGLE's drafter (``head.variant=peagle`` on EAGLE-3; ``heads.variants.peagle``): a chain of K drafts from ONE head
forward per step, as vLLM's parallel drafting runs it.

Observing a row only records its newly accepted (feature, next token) pairs. Drafting runs one batched head
forward over every row's pending pairs followed by K-1 mask positions (``heads.variants.peagle.mask_inputs``): the output
at the row's last accepted position drafts token 1, the output at mask position d drafts token d+1. The pending
entries stay in the head cache; the masks' entries are dropped right after (the next step's accepted tokens take
their slots). Greedy takes each position's argmax; sampling draws each position from its own law q_d (returned
for the generator's min(1, p/q) chain check, lossless whatever q_d is). Chains only: the EAGLE-2 dynamic tree
is not implemented for P-EAGLE (its drafts do not condition on one another, so a tree would be a product of
per-depth candidates; left out). Eager only: ``compile`` leaves this drafter as it is.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from draftsmith.heads.variants.peagle import mask_inputs
from draftsmith.infer.cache import StaticHeadCache, buffer_size
from draftsmith.infer.drafters.base import Chain, Draft, Sampling, chain_buffers, draft_by_batch, root_only, stack_rows
from draftsmith.infer.drafters.eagle import EagleState
from draftsmith.infer.drafters.eagle3 import Eagle3Drafter


@dataclass
class PEagleState(EagleState):
    # observed (features (1, A, F), next tokens (1, A)) pairs not yet run through the head: the next draft's forward
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)


class PEagleDrafter(Eagle3Drafter):
    shapes = (Chain,)

    def __init__(self, head: nn.Module, target: nn.Module, tree: Chain, confidence: float | None = None) -> None:
        if not isinstance(tree, Chain):
            raise ValueError(f"P-EAGLE heads draft chains (K tokens from one forward), not a {type(tree).__name__}: "
                             "the dynamic tree is not implemented for P-EAGLE")
        if tree.length > head.config.num_depths:
            raise ValueError(f"a chain of {tree.length} exceeds this P-EAGLE head's num_depths={head.config.num_depths} "
                             "(the depths it was trained to draft)")
        super().__init__(head, target, tree, confidence)

    @staticmethod
    def longest_chain(head: nn.Module) -> int:
        """The depths it was trained to draft (``num_depths``)."""
        return head.config.num_depths

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[PEagleState]:
        cache = StaticHeadCache(buffer_size(max(lengths) + self._explored + 1), rows=len(lengths))
        return [PEagleState(cache, b) for b in range(len(lengths))]

    def observe_rows(self, states: list[PEagleState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        for state, feature, tokens in zip(states, features, next_tokens):
            state.pending.append((feature, tokens))

    def rewind_rows(self, states: list[PEagleState], lengths: list[int]) -> None:
        for state, length in zip(states, lengths):
            cached = state.cache.row_lengths()[state.row]
            if length <= cached:
                state.cache.crop_row(state.row, length)
                state.pending = []
            elif state.pending:
                feature, tokens = _pending(state)
                state.pending = [(feature[:, : length - cached], tokens[:, : length - cached])]

    def propose_rows(self, states: list[PEagleState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        return draft_by_batch(states, roots, max_depths, self.option.length,
                              lambda cache, rows, tips, lengths: self._parallel(cache, rows, tips, lengths, sampling))

    def compile_with(self, compile: bool | str) -> None:
        """Eager: one forward per step already."""

    def _parallel(self, cache: StaticHeadCache, states: list[PEagleState], roots: list[Tensor], lengths: list[int],
                  sampling: Sampling) -> list[Draft]:
        """One head forward for every row of ``cache``: each row's pending pairs, then max(lengths) - 1 masks."""
        if any(not s.pending for s in states):
            raise RuntimeError("P-EAGLE drafts from the tokens observed since its last draft: observe_rows first")
        masks = max(max(lengths), 1) - 1
        index = [s.row for s in states]
        pending = [_pending(s) for s in states]
        dtype = pending[0][0].dtype
        pieces = []
        for feature, tokens in pending:
            hidden, embeds = mask_inputs(self.head, 1, masks, dtype)
            pieces.append(torch.cat([torch.cat([self._project(feature), hidden], 1),
                                     torch.cat([self.embed(tokens).to(dtype), embeds], 1)], -1))
        inputs, counts = stack_rows(cache.rows, index, pieces)  # (rows, A + masks, 2H)
        prefix = cache.row_lengths()
        hidden, embeds = inputs.chunk(2, dim=-1)
        position = torch.tensor(prefix, device=inputs.device)[:, None] + torch.arange(inputs.shape[1],
                                                                                     device=inputs.device)
        cache.counts = counts
        try:
            out = self.head(hidden_states=hidden, inputs_embeds=embeds, position_ids=position,
                            attention_mask=cache.causal_mask(inputs.shape[1], dtype, inputs.device),
                            past_key_values=cache).hidden_states
        finally:
            cache.counts = None
        accepted = [prefix[b] + (counts[b] - masks if b in index else 0) for b in range(cache.rows)]
        cache.crop_rows(accepted)  # the masks' entries go; the accepted tokens' stay
        for state in states:
            state.pending = []
        last = torch.tensor([counts[b] - masks - 1 for b in index], device=out.device)  # (R,) each last accepted
        at = last[:, None] + torch.arange(masks + 1, device=out.device)  # (R, K)
        out = out[index].gather(1, at[..., None].expand(-1, -1, out.shape[-1]))  # (R, K, H)
        return self._drafts(self._logits(out), roots, lengths, sampling)

    def _drafts(self, logits: Tensor, roots: list[Tensor], lengths: list[int], sampling: Sampling) -> list[Draft]:
        """Each row's chain from its positions' logits (R, K, Vd): argmax, or a draw from each position's law."""
        law = None
        if sampling.greedy:
            ids = logits.argmax(-1)  # (R, K)
            if self.confidence is not None:  # as EAGLE's chains: stop before the first unsure draft after the first
                sure = logits.softmax(-1).amax(-1) >= self.confidence
                sure[:, 0] = True
                kept = sure.int().cumprod(dim=1).sum(dim=1).tolist()
                lengths = [min(n, k) for n, k in zip(lengths, kept)]
        else:
            q = sampling.probs(logits)  # (R, K, Vd)
            ids = torch.multinomial(q.flatten(0, 1), 1).view(q.shape[:2])
            law = q.new_zeros(*q.shape[:2], self.vocab_size)
            law[..., self._to_target(torch.arange(q.shape[-1], device=q.device))] = q
        chain = self._to_target(ids)
        drafts = []
        for i, (root, n) in enumerate(zip(roots, lengths)):
            if n <= 0:
                drafts.append(root_only(root))
                continue
            tokens = torch.cat([root.reshape(1), chain[i, :n]])
            drafts.append(Draft(tokens, chain_buffers(n, tokens.device), None if law is None else law[i, :n]))
        return drafts


def _pending(state: PEagleState) -> tuple[Tensor, Tensor]:
    """A row's pending (features (1, A, F), next tokens (1, A)), its observations in order."""
    return torch.cat([f for f, _ in state.pending], 1), torch.cat([t for _, t in state.pending], 1)


DRAFTER = PEagleDrafter
