"""Helpers moved out of tests/infer/test_infer_hybrid.py (other test files share them; no tests here)."""
from __future__ import annotations

import random

import torch
from support.hybrids import make_tiny_hybrid

from draftsmith.infer.bench.batch import left_pad


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
