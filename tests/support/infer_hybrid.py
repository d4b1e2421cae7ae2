"""Helpers moved out of tests/infer/test_infer_hybrid.py (other test files share them; no tests here)."""
from __future__ import annotations

import random

import torch
from support.hybrids import make_tiny_hybrid

from draftsmith.infer.bench.batch import left_pad
from draftsmith.infer.drafters import Draft, Drafter, Sampling, chain_draft, root_only
from draftsmith.infer.tree import tree_from_parents


MAIN = ("qwen3_5_text", "qwen3_next", "lfm2", "nemotron_h")  # the four, every drafter on each
VOCAB = 96

TARGETS: dict[tuple, torch.nn.Module] = {}


def hybrid_target(arch: str, seed: int = 0, **kw):
    key = (arch, seed, tuple(sorted(kw.items())))
    if key not in TARGETS:  # built once per session: a tiny hybrid takes a second or two
        model = make_tiny_hybrid(arch, seed=seed, **kw)
        model.generation_config.eos_token_id = None
        TARGETS[key] = model
    return TARGETS[key]


def hf(model, ids, max_new, eos=None, mask=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, do_sample=False,
                          max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)


def hybrid_prompt(rng: random.Random, length: int) -> torch.Tensor:
    motif = [rng.randrange(3, VOCAB) for _ in range(4)]
    return torch.tensor([[1] + [motif[i % 4] if rng.random() < 0.8 else rng.randrange(3, VOCAB)
                                for i in range(length - 1)]])


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) (B, P) of the 1-D prompts ``rows``, padded on the left with 0."""
    return left_pad([r.tolist() for r in rows], 0, torch.device("cpu"))


def perturbed(head, seed: int = 0, scale: float = 0.05):
    """A random head moved off its init everywhere (a fresh DFlash/EAGLE head drafts little variety)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return head.eval()


class Oracle(Drafter):
    """Stub drafter that knows the target's greedy text ``ref`` (B, L), row b's in ``ref[b]``: a chain of
    ``good`` right tokens then a wrong one (a partial accept at every step), or with ``tree=True`` the
    root's two children, a wrong sibling first, then the right one and its right child."""

    aux_layer_ids = ()

    def __init__(self, ref: torch.Tensor, good: int = 3, tree: bool = False) -> None:
        self.refs, self.good, self.tree = ref, good, tree
        self.max_nodes = good + 2

    def new_rows(self, prompts, lengths):
        return [{"seq": p[0, :1], "ref": self.refs[b]} for b, p in enumerate(prompts)]

    def observe_rows(self, states, features, next_tokens):
        for state, tokens in zip(states, next_tokens):
            state["seq"] = torch.cat([state["seq"], tokens[0]])

    def propose_rows(self, states, roots, sampling: Sampling, max_depths: list[int]) -> list[Draft]:
        return [self._propose(s, r, d) for s, r, d in zip(states, roots, max_depths)]

    def _propose(self, state, root, max_depth: int) -> Draft:
        n = state["seq"].numel()
        right = state["ref"][n: n + min(self.good, max_depth)]
        if right.numel() < 2:
            return root_only(root)
        wrong = (right + 1) % VOCAB
        if self.tree:  # root -> wrong sibling, root -> right[0] -> right[1]
            return Draft(torch.stack([root, wrong[0], right[0], right[1]]), tree_from_parents([-1, 0, 0, 2]))
        return chain_draft([root, *right[:-1], wrong[-1]], [])
