"""Helpers moved out of tests/infer/test_infer_classic.py (other test files share them; no tests here)."""
from __future__ import annotations

import random

import pytest
import torch
from support.targets import make_tiny_target
from support.sampling import VOCAB as SMALL_VOCAB


VOCAB = 48
ARCHES3 = ("llama", "qwen2", "mistral")


def classic_target(arch: str, seed: int = 0, **kw):
    model = make_tiny_target(arch, vocab_size=VOCAB, initializer_range=0.3, seed=seed, **kw)
    model.generation_config.eos_token_id = None
    return model


def hf(model, ids, max_new, eos=None):
    # An explicit all-ones mask: otherwise HF masks context tokens equal to the pad id.
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=eos, pad_token_id=0)


def repetitive_prompt(rng: random.Random, length: int) -> torch.Tensor:
    motif = [rng.randrange(3, VOCAB) for _ in range(5)]
    return torch.tensor([[1] + [motif[i % 5] if rng.random() < 0.8 else rng.randrange(3, VOCAB)
                                for i in range(length - 1)]])


def small_pair_of(arch: str):
    """A small-vocabulary target of ``arch`` (exact laws over 3 tokens are cheap) and a draft LM of it."""
    kw = dict(vocab_size=SMALL_VOCAB, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32,
              initializer_range=0.5)
    target = make_tiny_target(arch, seed=3, **kw)
    draft = make_tiny_target(arch, seed=11, num_layers=2, **kw)  # a different law from the target's
    target.generation_config.eos_token_id = None
    return target, draft


@pytest.fixture(scope="module")
def small_pair():
    return small_pair_of("llama")
