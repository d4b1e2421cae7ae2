"""N-gram drafter (prompt lookup): draft what followed earlier occurrences of the last n tokens.

For n from ``max_ngram`` down to ``min_ngram``, the last n tokens of prompt + generated text are
compared against every earlier window at once (one vectorised comparison over the context, no
Python loop over it); the first n with a match wins. Matches are ranked by how many tokens they
can draft (up to ``length``), the most recent first among equals: on looping text the most recent
match sits right behind the cursor and can draft only a few tokens, so a full continuation wins.
(HF's prompt lookup takes the first match.) With ``branches=1`` the best continuation is drafted as
a chain; with more branches the best ones are merged into a prefix tree (shared prefixes become one
path, siblings are distinct), verified in one target forward.
No match: the step verifies the root alone (one token, as vanilla decoding).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from draftsmith.data.base.checks import count
from draftsmith.infer.drafters.base import Draft, Drafter, Sampling, root_only
from draftsmith.infer.tree import tree_from_parents


@dataclass
class NgramState:
    seq: Tensor | None = None  # (L,) every emitted token, prompt first; seq[-1] is the root


def find_continuations(seq: Tensor, max_ngram: int, min_ngram: int, length: int, branches: int) -> list[Tensor]:
    """Continuations (each (<= length,)) after the earlier matches of seq's suffix, the longest
    first (capped at ``length``), the most recent first among equally long ones."""
    total = seq.numel()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        windows = seq[:-1].unfold(0, n, 1)  # (total - n, n): every earlier window (the suffix excluded)
        hits = (windows == seq[-n:]).all(dim=1).nonzero()[:, 0]  # sync: window starts
        if hits.numel():
            starts = (hits + n).flip(0)  # (H,) continuation starts, most recent first
            usable = (total - starts).clamp(max=length)  # tokens each match can draft
            order = torch.sort(usable, descending=True, stable=True).indices  # stable: recency breaks ties
            return [seq[s: s + length] for s in starts[order][:branches].tolist()]
    return []


def prefix_tree(root: Tensor, paths: list[Tensor]) -> Draft:
    """Merge token paths under ``root`` into a tree (depth order, distinct siblings)."""
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    tokens, parents, depths = [int(root)], [-1], [0]
    for path in paths:
        node = 0
        for tok in path.tolist():
            if (node, tok) not in children:
                children[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                depths.append(depths[node] + 1)
            node = children[(node, tok)]
    # Depth order: sort nodes by depth (stable), remap parents.
    order = sorted(range(len(tokens)), key=lambda i: depths[i])
    rank = {old: new for new, old in enumerate(order)}
    ids = torch.tensor([tokens[i] for i in order], dtype=torch.long, device=root.device)
    return Draft(ids, tree_from_parents([-1 if parents[i] < 0 else rank[parents[i]] for i in order], root.device))


class NgramDrafter(Drafter):
    """Prompt-lookup drafts: up to ``length`` tokens from up to ``branches`` matches."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, length: int = 8, branches: int = 1) -> None:
        min_ngram, max_ngram = count("NgramDrafter min_ngram", min_ngram), count("NgramDrafter max_ngram", max_ngram)
        length, branches = count("NgramDrafter length", length), count("NgramDrafter branches", branches)
        if min_ngram > max_ngram:
            raise ValueError(f"NgramDrafter needs min_ngram <= max_ngram, got {min_ngram} > {max_ngram}")
        self.max_ngram, self.min_ngram, self.length, self.branches = max_ngram, min_ngram, length, branches
        self.max_nodes = 1 + length * branches  # the most nodes a draft has, root included

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[NgramState]:
        return [NgramState(prompt[0, :1]) for prompt in prompts]  # observe_rows appends the rest

    def observe_rows(self, states: list[NgramState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        for state, tokens in zip(states, next_tokens):
            state.seq = torch.cat([state.seq, tokens[0].to(state.seq.device)])

    def propose_rows(self, states: list[NgramState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """Each row's lookup on its own text."""
        return [self._propose(s, r, d) for s, r, d in zip(states, roots, max_depths)]

    def _propose(self, state: NgramState, root: Tensor, max_depth: int) -> Draft:
        length = min(self.length, max_depth)
        if length <= 0:
            return root_only(root)
        paths = find_continuations(state.seq, self.max_ngram, self.min_ngram, length, self.branches)
        paths = [p for p in paths if p.numel()]
        if not paths:
            return root_only(root)
        return prefix_tree(root, paths)
