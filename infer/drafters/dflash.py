"""DFlash's drafter: one head forward over ``[root, MASK, ...]`` proposes a chain of up to
``block_size - 1`` tokens. Context K/V of accepted tokens are appended to the head's cache as the
generator observes them and never recomputed; the block's own K/V are never cached.

The block is always ``block_size`` long (the shape the head was trained on: positions attend to each
other, so a shorter block would change every draft); a chain of n keeps its first n drafts. Greedy
takes each position's argmax; sampling draws each position from its own law q_k (positions are
drafted independently given the context), which the generator's min(1, p/q) chain check keeps lossless.

DFlash2 (``head.selector``): the block's unary logits give each position its top-k candidates, and the
selector walks them from the root, scoring each candidate after the token chosen before it
(``select_path``); greedy takes the best score, sampling draws from the sampling law of the scores over the
candidates (zero elsewhere), which the same chain check keeps lossless. The target verifies it as a chain.

DSpark and Domino draft from every slot, the root's included (slot k: the token k+1 after the root), each
walking the block its own way: their drafters (``infer.drafters.variants``) subclass this one and override
``_walk`` (and DSpark ``_set_confidence``).

A batch's rows share one context cache (``StaticHeadCache`` with a row each): observing and drafting
run one head pass for every row (a row's block sees its own context only, through an additive mask).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from draftsmith.heads.layers import additive_mask
from draftsmith.infer.cache import StaticHeadCache, buffer_size
from draftsmith.infer.compiling import compiled, step_begin
from draftsmith.infer.drafters.base import (Chain, Draft, HeadDrafter, Sampling, chain_buffers, draft_by_batch, group_rows,
                                 root_only, stack_rows)

CPU_CHAIN = 4  # on CPU every verified token costs (EAGLE's measured chain sweet spot, docs/benchmarks.md)


def select_path(selector: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, root: torch.Tensor,
                sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DFlash2's walk over the block: (tokens (R, n), laws (R, n, V) or None when greedy).

    hidden (R, n, H): the head's normed outputs of block positions 1..n; logits (R, n, V) float32: their
    unary logits; root (R,): the token before position 1. Position k's candidates are its top-k unary
    logits; each is scored by the selector after the token chosen at k-1 (the root for k = 1)."""
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # (R, n, K)
    tokens, laws, previous = [], [], root
    for k in range(logits.shape[1]):  # sequential: each choice conditions the next; the scores are (R, K)
        scores = selector(hidden[:, k], previous, candidates[:, k], unary[:, k])  # (R, K)
        if sampling.greedy:
            pick = scores.argmax(-1)
        else:  # the sampling law over the vocabulary, zero outside the candidates
            full = torch.full_like(logits[:, k], float("-inf")).scatter(-1, candidates[:, k], scores)
            law = sampling.probs(full)  # (R, V)
            laws.append(law)
            pick = torch.multinomial(law.gather(-1, candidates[:, k]), 1)[:, 0]
        previous = candidates[:, k].gather(-1, pick[:, None])[:, 0]  # (R,)
        tokens.append(previous)
    return torch.stack(tokens, 1), (torch.stack(laws, 1) if laws else None)


@dataclass
class DFlashState:
    cache: StaticHeadCache = field(default_factory=StaticHeadCache)  # context K/V of accepted tokens; shared by a batch
    row: int = 0  # this row's index in ``cache``


class DFlashDrafter(HeadDrafter):
    shapes = (Chain,)

    def __init__(self, head: nn.Module, target: nn.Module, tree: Chain, confidence: float | None = None) -> None:
        if not isinstance(tree, Chain):
            raise TypeError(f"DFlash heads draft a Chain, not {type(tree).__name__}")
        self._set_confidence(confidence)
        if tree.length > self.longest_chain(head):
            raise ValueError(f"Chain(length={tree.length}) exceeds this {head.title} head's block_size"
                             f"{'' if head.config.first_draft_slot == 0 else ' - 1'} = {self.longest_chain(head)}")
        self.head = head
        self.option = tree
        self.aux_layer_ids = tuple(head.feature_layer_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.max_nodes = tree.length + 1
        self.block_size = head.config.block_size
        self._mask_ids: dict[str, torch.Tensor] = {}  # device -> (B-1,) mask ids

    def _set_confidence(self, confidence: float | None) -> None:
        """DFlash reads no confidence (DSpark's drafter reads its threshold here)."""
        if confidence is not None:
            raise ValueError("confidence stops EAGLE chains early; a DFlash block drafts all positions at once")

    def new_rows(self, prompts: list[torch.Tensor], lengths: list[int]) -> list[DFlashState]:
        """The rows of a batch, on one context cache with a row each."""
        cache = StaticHeadCache(buffer_size(max(lengths) + 1), rows=len(lengths))
        return [DFlashState(cache, b) for b in range(len(lengths))]

    def observe_rows(self, states: list[DFlashState], features: list[torch.Tensor],
                     next_tokens: list[torch.Tensor]) -> None:
        """Every row's new context K/V in one pass per batch (rows padded to the longest)."""
        for group in group_rows(states).values():
            cache = states[group[0]].cache
            feats, counts = stack_rows(cache.rows, [states[i].row for i in group], [features[i] for i in group])
            lengths = torch.tensor(cache.row_lengths(), device=feats.device)
            positions = lengths[:, None] + torch.arange(feats.shape[1], device=feats.device)[None]  # (rows, A)
            cache.counts = counts
            try:
                self.head.extend_context(cache, feats, positions)
            finally:
                cache.counts = None

    def rewind_rows(self, states: list[DFlashState], lengths: list[int]) -> None:
        """Each row's context cache keeps the K/V of its first ``lengths[i]`` tokens."""
        for state, length in zip(states, lengths):
            state.cache.crop_row(state.row, length)

    def propose_rows(self, states: list[DFlashState], roots: list[torch.Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """One block pass per batch drafts every row's chain."""
        return draft_by_batch(states, roots, max_depths, self.option.length,
                              lambda cache, rows, tips, lengths: self._blocks(cache, rows, tips, lengths, sampling))

    def _blocks(self, cache: StaticHeadCache, states: list[DFlashState], roots: list[torch.Tensor],
                lengths: list[int], sampling: Sampling) -> list[Draft]:
        longest = max(lengths)
        if longest <= 0:
            return [root_only(r) for r in roots]
        device = roots[0].device
        key = str(device)
        if key not in self._mask_ids:
            self._mask_ids[key] = torch.full((self.block_size - 1,), self.head.config.mask_token_id,
                                             dtype=torch.long, device=device)
        rows = [s.row for s in states]
        first, _ = stack_rows(cache.rows, rows, [r.reshape(1, 1) for r in roots])  # (rows, 1)
        block = torch.cat([first, self._mask_ids[key].expand(cache.rows, -1)], dim=1)  # (rows, B)
        context = cache.row_lengths()
        starts = torch.tensor(context, device=device)  # (rows,) each root's position
        if self._fixed_block is not None:  # compiled: over the whole context buffers, one shape
            step_begin(device)
            logits, hidden = self._fixed_block(cache.buffers(), block, starts)
        else:  # eager: over the filled context only
            logits, hidden = self._block_logits(cache.context(), block, starts)
        logits, hidden = logits[:, :longest], hidden[:, :longest]
        chain, law, lengths = self._walk(hidden, logits, block[:, 0], sampling, states, lengths)
        drafts = []
        for state, root, n in zip(states, roots, lengths):
            b = state.row
            if n == 0:
                drafts.append(root_only(root))
                continue
            ids = torch.cat([root.reshape(1), chain[b, :n]])
            drafts.append(Draft(ids, chain_buffers(n, device), None if law is None else law[b, :n]))
        return drafts

    def _walk(self, hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor, sampling: Sampling,
              states: list[DFlashState], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """(chain (rows, n), laws (rows, n, V) or None when greedy, each row's draft length) from the block's
        normed outputs ``hidden`` (rows, n, H) and float32 ``logits`` (rows, n, V) after ``roots`` (rows,):
        DFlash2's selector path through the candidates, else each position's argmax or draw."""
        if self.head.selector is not None:
            return (*select_path(self.head.selector, hidden, logits, roots, sampling), lengths)
        if sampling.greedy:
            return logits.argmax(-1), None, lengths
        law = sampling.probs(logits)  # (rows, n, V)
        return torch.multinomial(law.flatten(0, 1), 1).view(law.shape[:2]), law, lengths

    _fixed_block = None  # set by compile_with

    def compile_with(self, compile: bool | str) -> None:
        """Compiled: the block pass reads the whole context buffers (``StaticHeadCache.buffers``), so its
        shapes do not change with the rows' lengths; compiled once per (rows, cache capacity)."""
        device = self.embed.weight.device
        self._fixed_block = compiled(self._block_logits, compile, device, self.head) if compile else None

    def _block_logits(self, context: list[tuple[torch.Tensor, torch.Tensor]], block: torch.Tensor,
                      starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits (rows, D, V) and normed outputs (rows, D, H) of every row's block (rows, B) after its
        first ``starts[b]`` context entries (each row's block sees its own context and the whole block; entries
        past a row's context are hidden): the D = ``drafts_per_block`` drafting slots, DFlash's 1..B-1 (slot k
        drafts the token k after the root), DSpark's and Domino's 0..B-1 (slot k the token k+1 after it)."""
        device = block.device
        width = context[0][0].shape[2]
        positions = starts[:, None] + torch.arange(self.block_size, device=device)[None]
        columns = torch.arange(width + self.block_size, device=device)[None]
        seen = (columns < starts[:, None]) | (columns >= width)  # (rows, C + B)
        embeds = self.embed(block)
        mask = additive_mask(seen[:, None, :].expand(-1, self.block_size, -1), embeds.dtype)[0, 0][:, None]
        out = self.head(embeds, positions, context, mask)[:, self.head.config.first_draft_slot:]
        return self.lm_head(out).float(), out

    @classmethod
    def branching_tree(cls, device: torch.device) -> Chain:
        """DFlash drafts chains only: on CPU a chain of 4 (each verified token costs there), on
        accelerators the whole block of the published drafters (15 drafts)."""
        return Chain(CPU_CHAIN) if torch.device(device).type == "cpu" else Chain(15)

    @staticmethod
    def longest_chain(head: nn.Module) -> int:
        return head.config.drafts_per_block

    @classmethod
    def fits(cls, head: nn.Module, tree) -> bool:
        return isinstance(tree, Chain) and tree.length <= cls.longest_chain(head)


DRAFTER = DFlashDrafter
