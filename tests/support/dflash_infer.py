"""Helpers moved out of tests/infer/test_dflash_infer.py (other test files share them; no tests here)."""
from __future__ import annotations

import dataclasses
import random

import torch
from support.reference import hf_greedy

from draftsmith.train.config import load_config
from draftsmith.train.losses import DraftTargets
from draftsmith.train.objectives import objective_class


def perturbed(head, large, seed: int = 5, scale: float = 0.5):
    """``head`` in eval mode with every weight moved by noise of ``scale``, those whose name ``large`` picks by 3.0
    (a variant's own part made to matter: DSpark's Markov factors, Domino's correction)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (3.0 if large(name) else scale))
    return head.eval()


def successor_training_data(vocab: int):
    """The successor target and its greedy continuations of 96 random 4-token prompts (24 new tokens each),
    the trained-head tests' data."""
    from support.targets import make_successor_target

    model = make_successor_target(vocab)
    with torch.no_grad():
        torch.manual_seed(0)
        seqs = hf_greedy(model, torch.randint(3, vocab, (96, 4)), 24)
    return model, seqs


def fit_dflash(model, seqs, head, steps: int, *overrides: str, losses: list | None = None, rows: int = 4):
    """``steps`` AdamW steps (lr 5e-3) of the DFlash objective on ``rows`` random rows of ``seqs`` (n, T) each, the
    target's features computed once for all rows (the objective told each step, as the loop tells it);
    ``overrides`` are config key=values; each step's loss appended to ``losses``. Returns the head, in eval mode.
    4 rows by default, not 16: these heads learn per step more than per row (DFlash's and DSpark's mean τ after
    the same steps on 4 rows as on 16 within 0.06, DFlash2's higher, at a third to a half of the time;
    docs/testing.md, round 4)."""
    objective = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash", *overrides]))
    opt = torch.optim.AdamW(head.parameters(), lr=5e-3)
    lm_head = model.get_output_embeddings()
    every = objective.features(model, {"input_ids": seqs, "loss_mask": torch.ones_like(seqs)}, head)  # once
    for step in range(steps):
        picked = torch.randint(0, seqs.shape[0], (rows,))
        features = dataclasses.replace(
            every, input_ids=every.input_ids[picked], loss_mask=every.loss_mask[picked], hidden=every.hidden[picked],
            embeds=every.embeds[picked], top1=every.top1[picked],
            targets=DraftTargets(*(t[picked] for t in every.targets)))
        objective.at_step(step, steps)
        objective.perturb(features, None, seed=step)
        loss = objective(features, lm_head).loss
        if losses is not None:
            losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def mean_tau_of_identical_decodes(model, gen, vocab: int) -> float:
    """Three fixed random prompts decoded by ``gen`` (20, 25, 30 new tokens), each asserted token-identical to the
    target's own greedy ``generate``; the mean of their τ."""
    taus = []
    for i, ids in enumerate(torch.randint(3, vocab, (3, 5), generator=torch.Generator().manual_seed(1))):
        ids, max_new = ids[None], 20 + 5 * i
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), hf_greedy(model, ids, max_new))
        taus.append(gen.last_stats.tau)
    return sum(taus) / len(taus)


def batch_target(arch: str):
    """The batch tests' target: a tiny llama or a Qwen3.5-style hybrid, no EOS."""
    from support.hybrids import make_tiny_hybrid
    from support.targets import make_tiny_target

    target = make_tiny_target("llama", initializer_range=0.3) if arch == "llama" else make_tiny_hybrid(arch, seed=0)
    target.generation_config.eos_token_id = None
    return target


def assert_rows_alone(target, head, arch: str, vocab: int) -> None:
    """Eight left-padded rows of different lengths, one chain of 4: every row's output equals HF greedy of that
    row alone."""
    from draftsmith.infer import Chain, SpeculativeGenerator
    from draftsmith.infer.bench.batch import left_pad

    rng = random.Random(arch)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 9, 4, 12, 2, 7, 5, 3)]
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    out = SpeculativeGenerator(target, head, tree=Chain(4)).generate(ids, attention_mask=mask, max_new_tokens=14)
    for b, prompt in enumerate(prompts):
        alone = hf_greedy(target, torch.tensor([prompt]), 14)[0, len(prompt):]
        assert torch.equal(out[b, ids.shape[1]:], alone), b


def assert_loads_and_decodes_alike(head, loaded, target, variant: str) -> None:
    """An exported head read back: its variant, the same tensors, and the same greedy tokens as the head and as
    HF's greedy decode of ``target`` (one chain of 4, 12 new tokens)."""
    from draftsmith.infer import Chain, SpeculativeGenerator

    a, b = head.state_dict(), loaded.state_dict()
    assert loaded.config.variant == variant and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[4, 9, 13, 4, 9]])
    runs = [SpeculativeGenerator(target, h, tree=Chain(4)).generate(ids, max_new_tokens=12) for h in (head, loaded)]
    assert torch.equal(*runs) and torch.equal(runs[0], hf_greedy(target, ids, 12))
