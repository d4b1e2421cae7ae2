"""DFlash's drafter: one head forward over ``[root, MASK, ...]`` proposes a chain of up to
``block_size - 1`` tokens. Context K/V of accepted tokens are appended to the head's cache as the
generator observes them and never recomputed; the block's own K/V are never cached.

The block is always ``block_size`` long (the shape the head was trained on: positions attend to each
other, so a shorter block would change every draft); a chain of n keeps its first n drafts. Greedy
takes each position's argmax; sampling draws each position from its own law q_k (positions are
drafted independently given the context), which the generator's min(1, p/q) chain check keeps lossless.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from heads.layers import HeadCache
from infer.cache import StaticHeadCache
from infer.drafters.base import Chain, Draft, HeadDrafter, Sampling, chain_draft, root_only

CPU_CHAIN = 4  # on CPU every verified token costs (EAGLE's measured chain sweet spot, docs/benchmarks.md)


@dataclass
class DFlashState:
    cache: HeadCache | StaticHeadCache = field(default_factory=HeadCache)  # context K/V of accepted tokens


class DFlashDrafter(HeadDrafter):
    shapes = (Chain,)

    def __init__(self, head: nn.Module, target: nn.Module, tree: Chain, confidence: float | None = None) -> None:
        if not isinstance(tree, Chain):
            raise TypeError(f"DFlash heads draft a Chain, not {type(tree).__name__}")
        if confidence is not None:
            raise ValueError("confidence stops EAGLE chains early; a DFlash block drafts all positions at once")
        if tree.length > self.longest_chain(head):
            raise ValueError(f"Chain(length={tree.length}) exceeds this DFlash head's block_size - 1 = "
                             f"{self.longest_chain(head)}")
        self.head = head
        self.option = tree
        self.aux_layer_ids = tuple(head.feature_layer_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.max_nodes = tree.length + 1
        self.block_size = head.config.block_size
        self._mask_ids: dict[str, torch.Tensor] = {}  # device -> (B-1,) mask ids

    def new_state(self) -> DFlashState:
        return DFlashState()

    def reserve(self, state: DFlashState, length: int) -> None:
        state.cache = StaticHeadCache(length + 1)

    def observe(self, state: DFlashState, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        start = state.cache.get_seq_length()
        positions = torch.arange(start, start + features.shape[1], device=features.device)[None]
        self.head.extend_context(state.cache, features, positions)

    def propose(self, state: DFlashState, root: torch.Tensor, sampling: Sampling, max_depth: int) -> Draft:
        length = min(self.option.length, max_depth)
        if length <= 0:
            return root_only(root)
        key = str(root.device)
        if key not in self._mask_ids:
            self._mask_ids[key] = torch.full((self.block_size - 1,), self.head.config.mask_token_id,
                                             dtype=torch.long, device=root.device)
        block = torch.cat([root.reshape(1), self._mask_ids[key]])[None]  # (1, B)
        start = state.cache.get_seq_length()  # the root's position
        positions = torch.arange(start, start + self.block_size, device=root.device)[None]
        out = self.head(self.embed(block), positions, self.head.cached_context(state.cache))
        logits = self.lm_head(out[0, 1: 1 + length]).float()  # (n, V): position k drafts root + k
        if sampling.greedy:
            return chain_draft([root, *logits.argmax(-1)], [])
        q = sampling.probs(logits)  # (n, V)
        return chain_draft([root, *torch.multinomial(q, 1)[:, 0]], list(q))

    @classmethod
    def branching_tree(cls, device: torch.device) -> Chain:
        """DFlash drafts chains only: on CPU a chain of 4 (each verified token costs there), on
        accelerators the whole block of the published drafters (15 drafts)."""
        return Chain(CPU_CHAIN) if torch.device(device).type == "cpu" else Chain(15)

    @staticmethod
    def longest_chain(head: nn.Module) -> int:
        return head.config.block_size - 1

    @classmethod
    def fits(cls, head: nn.Module, tree) -> bool:
        return isinstance(tree, Chain) and tree.length <= cls.longest_chain(head)


DRAFTER = DFlashDrafter
