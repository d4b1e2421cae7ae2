"""The tests' one oracle drafter: it knows each row's greedy text (its prompt, then the target's own
continuation) and drafts around it, so a test decides what a step accepts and what the verify must reject.
(``infer.bench.oracle``'s ``OracleDrafter`` is the benchmarks': a chain or fixed tree, no checks.)"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import torch

from draftsmith.infer.drafters import Draft, Drafter, Sampling, chain_draft, root_only
from draftsmith.infer.tree import tree_from_parents

SHAPES = ("chain", "late", "fork", "tree", "ragged")


class Oracle(Drafter):
    """Drafts from ``refs``: each row's prompt + greedy continuation (1-D tensors, or the rows of a (B, L)
    one, no pads); a row's reference is the first that starts with its prompt, so rows may come in any order.

    ``shape``:
    - ``"chain"``: ``right`` right tokens, then (``wrong=True``) one wrong token, so every step accepts exactly
      ``right`` drafts (a partial accept at every step), or all of them with ``wrong=False``;
    - ``"late"``: a chain of one wrong token, then the ``right`` true tokens after it: acceptance is a leading run,
      so every step accepts none of them (counting matches per position would accept ``right``);
    - ``"fork"``: wrong then right: the root's two children, a wrong sibling first, then the right token
      and its right child;
    - ``"tree"``: random trees of ``depth`` levels (``seed``): the true token at each level (replaced by a wrong
      one with probability ``wrong_rate``) shuffled among 0-2 decoy siblings that carry decoy subtrees;
    - ``"ragged"``: as ``"tree"``, a random depth 1..``depth`` per step and decoys without subtrees, so the rows
      of a batch draft and accept different lengths.

    ``features`` (one (L, H) tensor per ref: the target's true final hidden states along it) turns on the
    checks: every forward the generator reports (its accepted tokens and their features) is asserted equal to
    the reference, and every root to the reference's token there. ``max_nodes`` (the budget a static cache
    or a compiled verify needs) is the chain's and fork's size; ``"ragged"`` gives ``1 + 3 * depth``,
    ``"tree"`` none unless given (``tree_budget(depth)`` bounds it)."""

    aux_layer_ids = ()

    def __init__(self, refs: torch.Tensor | Iterable[torch.Tensor], *, shape: str = "chain", right: int = 2,
                 wrong: bool = True, depth: int = 4, seed: int = 0, wrong_rate: float = 0.15,
                 features: Sequence[torch.Tensor] | None = None, max_nodes: int | None = None,
                 vocab: int = 96) -> None:
        if shape not in SHAPES:
            raise ValueError(f"shape={shape!r} is not one of {SHAPES}")
        self.refs = list(refs)
        self.features = None if features is None else list(features)
        self.shape, self.right, self.wrong, self.depth = shape, right, wrong, depth
        self.rng, self.wrong_rate, self.vocab = random.Random(seed), wrong_rate, vocab
        sizes = {"chain": 1 + right + wrong, "late": 2 + right, "fork": 4, "tree": None, "ragged": 1 + 3 * depth}
        self.max_nodes = sizes[shape] if max_nodes is None else max_nodes

    @staticmethod
    def tree_budget(depth: int) -> int:
        """The most nodes a ``"tree"`` draft of ``depth`` levels has: level d holds at most 2d + 1 (the true
        token, two siblings, one child per earlier decoy)."""
        return 1 + depth**2 + 2 * depth

    def new_rows(self, prompts: list[torch.Tensor], lengths: list[int]) -> list[dict]:
        states = []
        for prompt in prompts:  # (1, P_b), no pads
            i = next(i for i, r in enumerate(self.refs) if torch.equal(r[: prompt.shape[1]], prompt[0]))
            states.append({"seq": self.refs[i], "features": None if self.features is None else self.features[i],
                           "pos": 0})
        return states

    def observe_rows(self, states: list[dict], features: list[torch.Tensor], next_tokens: list[torch.Tensor]) -> None:
        for state, feats, tokens in zip(states, features, next_tokens):
            start, count = state["pos"], tokens.shape[1]
            if state["features"] is not None:
                assert torch.equal(tokens[0], state["seq"][start + 1 : start + 1 + count])
                tol = 1e-8 if feats.dtype == torch.float64 else 1e-4
                torch.testing.assert_close(feats[0], state["features"][start : start + count], rtol=tol, atol=tol)
            state["pos"] += count

    def propose_rows(self, states: list[dict], roots: list[torch.Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        return [self._propose(s, r, d) for s, r, d in zip(states, roots, max_depths)]

    def _propose(self, state: dict, root: torch.Tensor, max_depth: int) -> Draft:
        seq, pos = state["seq"], state["pos"]
        if state["features"] is not None:
            assert int(root) == int(seq[pos])
        if self.shape == "chain":
            take = seq[pos + 1 : pos + 1 + min(self.right + self.wrong, max_depth)]
            if not self.wrong:
                return root_only(root) if take.numel() < 1 else chain_draft([root, *take], [])
            return root_only(root) if take.numel() < 2 else chain_draft([root, *take[:-1], (take[-1] + 1) % self.vocab], [])
        if self.shape == "late":  # root -> wrong -> the true tokens after it
            take = seq[pos + 1 : pos + 1 + min(self.right + 1, max_depth)]
            return root_only(root) if take.numel() < 2 else chain_draft([root, (take[0] + 1) % self.vocab, *take[1:]], [])
        if self.shape == "fork":  # root -> wrong sibling, root -> right[0] -> right[1]
            right = seq[pos + 1 : pos + 1 + min(3, max_depth)]
            if right.numel() < 2:
                return root_only(root)
            return Draft(torch.stack([root, (right[0] + 1) % self.vocab, right[0], right[1]]),
                         tree_from_parents([-1, 0, 0, 2]))
        return self._random_tree(seq, pos, root, max_depth)

    def _random_tree(self, seq: torch.Tensor, pos: int, root: torch.Tensor, max_depth: int) -> Draft:
        ragged = self.shape == "ragged"
        depth = self.rng.randrange(1, self.depth + 1) if ragged else self.depth
        levels = min(depth, max_depth, seq.numel() - pos - 1)
        parents, tokens = [-1], [int(root)]
        main, decoys = 0, []  # node on the true path; decoy nodes of the previous level
        for d in range(1, levels + 1):
            truth = int(seq[pos + d])
            token = (truth + 1) % self.vocab if self.rng.random() < self.wrong_rate else truth
            level = [(main, token, True)]
            level += [(main, (truth + k) % self.vocab, False) for k in range(2, 2 + self.rng.randrange(3))]
            self.rng.shuffle(level)
            level += [(p, self.rng.randrange(self.vocab), False) for p in decoys]
            decoys = []
            for parent, tok, on_path in level:
                parents.append(parent)
                tokens.append(tok)
                if on_path:
                    main = len(tokens) - 1
                elif not ragged:
                    decoys.append(len(tokens) - 1)
        return Draft(torch.tensor(tokens), tree_from_parents(parents))
