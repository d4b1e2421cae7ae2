"""Helpers moved out of tests/infer/test_infer_batch.py (other test files share them; no tests here)."""
from __future__ import annotations

import random

import torch
from support.targets import make_tiny_target
from support.chooser import CHEAP
from support.oracle import Oracle
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, StaticTree
from draftsmith.infer.drafters import make_drafter
from draftsmith.infer.drafters.free.adaptive import AdaptiveLength
from draftsmith.infer.drafters.free.chooser import CostAwareLength
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.model import target_forward


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
    return hf_greedy(model, torch.tensor([prompt]), max_new, eos, pad=PAD)[0, len(prompt):]


def expected(model, prompts, max_new, eos=None) -> torch.Tensor:
    ids, _ = left_pad(prompts)
    rows = [batch_alone(model, p, max_new, eos) for p in prompts]
    width = max(r.numel() for r in rows)
    new = torch.full((len(prompts), width), PAD)
    for b, r in enumerate(rows):
        new[b, : r.numel()] = r
    return torch.cat([ids, new], dim=1)


def oracle(model, prompts, max_new, depth, seed) -> Oracle:
    """The ragged oracle over each prompt's own greedy text, its features checked."""
    refs = [hf_greedy(model, torch.tensor([p]), max_new, pad=PAD)[0] for p in prompts]
    with torch.no_grad():
        features = [target_forward(model, ref[None]).final_hidden[0] for ref in refs]
    return Oracle(refs, features=features, shape="ragged", depth=depth, seed=seed)


DRAFTERS = {
    "ngram": lambda m: (NgramDrafter(), None),
    "ngram-tree": lambda m: (NgramDrafter(max_ngram=2, length=4, branches=3), None),
    "draft-lm": lambda m: (LMDrafter(target(m.config.model_type, seed=5, num_layers=1), m, Chain(3)), None),
    "eagle-chain": lambda m: (build_head("eagle", m), Chain(3)),
    "eagle-tree": lambda m: (build_head("eagle", m), DynamicTree(depth=3, top_k=2, total_tokens=6)),
    "eagle3-chain": lambda m: (build_head("eagle3", m), Chain(4)),
    "eagle3-tree": lambda m: (build_head("eagle3", m), DynamicTree(depth=2, top_k=3, total_tokens=5)),
    "eagle3-adaptive": lambda m: (AdaptiveLength(make_drafter(build_head("eagle3", m), m, Chain(6)), initial=2), None),
    "eagle3-chosen": lambda m: (CostAwareLength(make_drafter(build_head("eagle3", m), m, Chain(6)), 6, CHEAP), None),
    "eagle3-chosen-tree": lambda m: (CostAwareLength(make_drafter(build_head("eagle3", m), m, DynamicTree(3, 2, 6)),
                                                     3, CHEAP), None),
    "dflash": lambda m: (build_head("dflash", m, block_size=4, num_layers=2), Chain(3)),
    "medusa-chain": lambda m: (build_head("medusa", m), Chain(3)),
    "medusa-tree": lambda m: (build_head("medusa", m), StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0)))),
    "layer-skip": lambda m: (LayerSkipDrafter(m, 2, Chain(3)), None),  # drafts into the target's cache
}
