"""Medusa's drafter: K heads read the last accepted token's final hidden state once and draft a
static tree (or a chain) of their ranked tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.infer.drafters.base import Chain, Draft, HeadDrafter, Sampling, StaticTree, chain_draft, root_only
from draftsmith.infer.tree import MEDUSA_DEFAULT_CHOICES, TreeBuffers, medusa_tree, tree_from_parents



@dataclass
class MedusaState:
    logits: Tensor | None = None  # (K, V) float32 head logits at the last accepted token


class MedusaDrafter(HeadDrafter):
    """Medusa heads on the final hidden state of the last accepted token; static tree or chain."""

    aux_layer_ids: tuple[int, ...] = ()
    shapes = (StaticTree, Chain)

    def __init__(self, head: nn.Module, target: nn.Module, tree: StaticTree | Chain,
                 confidence: float | None = None) -> None:
        if confidence is not None:
            raise ValueError("confidence stops EAGLE chains early; Medusa heads draft all levels at once")
        self.head = head
        self.option = tree
        num_heads = head.config.num_heads
        if isinstance(self.option, Chain):
            if self.option.length > num_heads:
                raise ValueError(f"Chain(length={self.option.length}) needs that many Medusa heads; this head has {num_heads}")
            self.tree = None
            self.max_nodes = self.option.length + 1
        elif isinstance(self.option, StaticTree):
            if self.option.sampled:
                raise ValueError("StaticTree(sampled=True) draws each node's children from its law: EAGLE heads "
                                 "draft it; Medusa heads draft their ranked tokens (sampled=False)")
            # Paths deeper than the head count cannot be drafted: drop them (keeps prefixes closed).
            choices = [c for c in self.option.choices if len(c) <= num_heads]
            self.tree = medusa_tree(choices)
            self.max_nodes = len(choices) + 1
            # host copies, read once here: pruning the tree for a shorter draft then reads no tensor
            self._host = (self.tree.buffers.parents.tolist(), self.tree.buffers.depths.tolist(), self.tree.ranks.tolist())
        else:
            raise TypeError(f"Medusa heads draft a StaticTree or a Chain, not {type(self.option).__name__}")
        # (max_depth, device) -> (buffers, ranks (N,), depth, top ranks needed): built once, no syncs later
        self._pruned: dict[tuple[int, str], tuple[TreeBuffers, Tensor, int, int]] = {}

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[MedusaState]:
        return [MedusaState() for _ in prompts]

    def rewind_rows(self, states: list[MedusaState], lengths: list[int]) -> None:
        """Nothing to cut: a state is the heads' logits at the last observed token, which the next
        observe replaces."""

    def observe_rows(self, states: list[MedusaState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        """One head pass over every row's last accepted feature."""
        last = torch.cat([f[:, -1:] for f in features])  # (R, 1, H)
        logits = self.head(last)[:, :, 0].float()  # (K, R, V)
        for i, state in enumerate(states):
            state.logits = logits[:, i]  # (K, V)

    def _tree_up_to(self, max_depth: int, device: torch.device) -> tuple[TreeBuffers, Tensor, int, int]:
        key = (max_depth, str(device))
        if key not in self._pruned:
            parents, depths, ranks = self._host
            keep = sum(d <= max_depth for d in depths)  # nodes are in depth order: a prefix
            buffers = tree_from_parents(parents[:keep], device)
            self._pruned[key] = (buffers, torch.tensor(ranks[:keep], device=device), depths[keep - 1],
                                 max(ranks[:keep]) + 1)
        return self._pruned[key]

    def propose_rows(self, states: list[MedusaState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """Each row's draft from its heads' logits (already computed for every row by ``observe_rows``)."""
        return [self._propose(s.logits, r, sampling, d) for s, r, d in zip(states, roots, max_depths)]

    def _propose(self, logits: Tensor, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        """One row's draft from its heads' logits (K, V)."""
        if isinstance(self.option, Chain):
            length = min(self.option.length, max_depth)
            if sampling.greedy:
                return chain_draft([root, *logits[:length].argmax(dim=-1)], [])
            q = sampling.probs(logits[:length])  # (L, V)
            return chain_draft([root, *torch.multinomial(q, 1)[:, 0]], list(q))
        buffers, ranks, depth, width = self._tree_up_to(min(max_depth, max(self._host[1])), root.device)
        if depth == 0:
            return root_only(root)
        top = logits[:depth].topk(width, dim=-1).indices  # (D, R) each head's ranked tokens
        drafts = top[buffers.depths[1:] - 1, ranks[1:]]  # (N-1,)
        return Draft(torch.cat([root.reshape(1), drafts]), buffers)

    @classmethod
    def branching_tree(cls, device: torch.device) -> StaticTree:
        """Accelerators: Medusa's reference tree (mc_sim_7b_63), where verifying 60 tokens costs about as
        much as one. On CPU every verified token costs (t(8)/t(1) = 1.3, t(32)/t(1) = 1.9 on the demo
        target), so only its first 15 nodes (every prefix of the list is a tree)."""
        return StaticTree(MEDUSA_DEFAULT_CHOICES[:15]) if torch.device(device).type == "cpu" else StaticTree()

    @staticmethod
    def longest_chain(head: nn.Module) -> int:
        return head.config.num_heads


DRAFTER = MedusaDrafter
