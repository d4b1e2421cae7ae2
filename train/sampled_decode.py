"""Decode τ at a temperature > 0 (``train.eval_temperature``): the head decodes the held-out prompts of the
run's decode set (``train.decode_tau``) with ``SpeculativeGenerator`` itself, sampling, each prompt under its own
fixed seed (``infer.seeded_decode``).

Greedy decode τ replays the generator without the target, since greedy verification emits the target's greedy
text whatever the drafts. A sampled decode's text depends on the drafts and the draws, so each verify needs the
target: here the generator runs with the head's drafter (``train.decode_tau.head_drafter``: the default draft,
its length adapting as at temperature 0, eager),
one prompt at a time, and τ is its ``GenerationStats`` pooled. Seeding each prompt from its tokens makes two
evaluations of one head give the same number and leaves the training's random stream untouched.
"""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.seeded_decode import seeded_generate
from draftsmith.train.decode_tau import DecodeSet, head_drafter


@torch.no_grad()
def sampled_row_counts(head: nn.Module, target: nn.Module, decode_set: DecodeSet, temperature: float,
                       seed: int = 0) -> list[tuple[int, int]]:
    """(verification steps, tokens they emitted) of each row's prompt decoded by the generator at
    ``temperature`` (top-k and top-p off), under ``prompt_seed(prompt, seed)``."""
    gen = SpeculativeGenerator(target, head_drafter(head, target), compile=False)
    counts = []
    for row in decode_set.rows:
        seeded_generate(gen, row.sequence[:, :row.prompt_length], seed, max_new_tokens=decode_set.max_new_tokens,
                        temperature=temperature)
        counts.append((gen.last_stats.steps, gen.last_stats.step_tokens))
    return counts
