"""Helpers moved out of tests/infer/test_infer_batch.py (other test files share them; no tests here)."""
from __future__ import annotations

import random

import torch
from support.targets import make_tiny_target
from support.train_fixtures import TreeOracle

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, StaticTree
from draftsmith.infer.drafters import Draft, make_drafter
from draftsmith.infer.drafters.free.adaptive import AdaptiveLength
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.model import target_forward
from draftsmith.infer.tree import tree_from_parents


VOCAB = 96
PAD = 0
BATCH_ARCHES = ("llama", "qwen2", "mistral")


def target(arch: str, **kw):
    model = make_tiny_target(arch, dtype=torch.float32, initializer_range=0.3, **kw)
    model.generation_config.eos_token_id = None  # EOS only where a test asks for it
    return model


def batch_prompts(rng: random.Random, lengths: list[int], repetitive: bool = False) -> list[list[int]]:
    if repetitive:  # something for the n-gram drafter to find
        return [[rng.choice((5, 6, 7, 8)) for _ in range(n)] for n in lengths]
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def batch_alone(model, prompt: list[int], max_new: int, eos=None) -> torch.Tensor:
    """The row's new tokens from HF's greedy generate of that row alone."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=eos,
                         pad_token_id=PAD)
    return out[0, len(prompt):]


def expected(model, prompts, max_new, eos=None) -> torch.Tensor:
    ids, _ = left_pad(prompts)
    rows = [batch_alone(model, p, max_new, eos) for p in prompts]
    width = max(r.numel() for r in rows)
    new = torch.full((len(prompts), width), PAD)
    for b, r in enumerate(rows):
        new[b, : r.numel()] = r
    return torch.cat([ids, new], dim=1)


class RowOracle(TreeOracle):
    """test_infer_generator's oracle (each row checked against its reference) drafting a random depth per
    step, decoy siblings without subtrees: rows of a batch draft and accept different lengths."""

    def __init__(self, references: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]], depth: int,
                 seed: int, wrong_rate: float = 0.15):
        super().__init__(references, depth, seed, wrong_rate)
        self.max_nodes = 1 + 3 * depth

    def _propose(self, state: dict, root: torch.Tensor, max_depth: int) -> Draft:
        seq, pos = state["seq"], state["pos"]
        assert int(root) == int(seq[pos])
        levels = min(self.rng.randrange(1, self.depth + 1), max_depth, seq.numel() - pos - 1)
        parents, tokens, main = [-1], [int(root)], 0
        for d in range(1, levels + 1):
            truth = int(seq[pos + d])
            token = (truth + 1) % VOCAB if self.rng.random() < self.wrong_rate else truth
            level = [(main, token, True)] + [(main, (truth + k) % VOCAB, False) for k in range(2, 2 + self.rng.randrange(3))]
            self.rng.shuffle(level)
            for parent, tok, on_path in level:
                parents.append(parent)
                tokens.append(tok)
                if on_path:
                    main = len(tokens) - 1
        return Draft(torch.tensor(tokens), tree_from_parents(parents))


def oracle(model, prompts, max_new, depth, seed) -> RowOracle:
    references = {}
    for p in prompts:
        full = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=PAD)
        with torch.no_grad():
            features = target_forward(model, full).final_hidden[0]
        references[tuple(p)] = (full[0], features)
    return RowOracle(references, depth, seed)


DRAFTERS = {
    "ngram": lambda m: (NgramDrafter(), None),
    "ngram-tree": lambda m: (NgramDrafter(max_ngram=2, length=4, branches=3), None),
    "draft-lm": lambda m: (LMDrafter(target(m.config.model_type, seed=5, num_layers=1), m, Chain(3)), None),
    "eagle-chain": lambda m: (build_head("eagle", m), Chain(3)),
    "eagle-tree": lambda m: (build_head("eagle", m), DynamicTree(depth=3, top_k=2, total_tokens=6)),
    "eagle3-chain": lambda m: (build_head("eagle3", m), Chain(4)),
    "eagle3-tree": lambda m: (build_head("eagle3", m), DynamicTree(depth=2, top_k=3, total_tokens=5)),
    "eagle3-adaptive": lambda m: (AdaptiveLength(make_drafter(build_head("eagle3", m), m, Chain(6)), initial=2), None),
    "dflash": lambda m: (build_head("dflash", m, block_size=4, num_layers=2), Chain(3)),
    "medusa-chain": lambda m: (build_head("medusa", m), Chain(3)),
    "medusa-tree": lambda m: (build_head("medusa", m), StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0)))),
    "layer-skip": lambda m: (LayerSkipDrafter(m, 2, Chain(3)), None),  # drafts into the target's cache
}
