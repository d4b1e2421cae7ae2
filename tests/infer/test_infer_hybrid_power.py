"""The hybrid identity checks can fail, on every family: each test model's greedy text depends on its
recurrent and conv states (zeroing them after a prompt changes at least a third of its next tokens), and
planted rollback bugs — none at all, a state restored one position off, one batch row's state given to
another — each break greedy identity with the target's own ``generate`` on every family in tests/support/hybrids.py."""
from __future__ import annotations

import random

import pytest
import torch
from support.hybrids import HYBRIDS
from support.infer_hybrid import Oracle, hf, hybrid_prompt, hybrid_target
from transformers import DynamicCache

from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.rollback import Merged, Replay
from draftsmith.target.recurrent import LinearAttentionLayer, LinearStates, _is_linear, _states

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

FAMILIES = sorted(HYBRIDS)


def _next_token(model, ids: torch.Tensor, zero_states: bool) -> int:
    """The greedy token after ``ids`` (1, L): its last token run alone after the others' prefill, from the
    states that prefill left (or from zeroed recurrent and conv states)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        if zero_states:
            for *_, state in _states({i: layer for i, layer in enumerate(cache.layers) if _is_linear(layer)}):
                state.zero_()
        position = torch.tensor([[ids.shape[1] - 1]])
        out = model(ids[:, -1:], past_key_values=cache, use_cache=True, position_ids=position)
    return int(out.logits[0, -1].argmax())


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_greedy_text_depends_on_the_states(arch):
    """Zeroing every recurrent and conv state after a prompt changes at least 2 of 6 next greedy tokens."""
    target = hybrid_target(arch)
    rng = random.Random(0)
    prompts = [hybrid_prompt(rng, 12) for _ in range(6)]
    changed = sum(_next_token(target, ids, False) != _next_token(target, ids, True) for ids in prompts)
    assert changed >= 2, (arch, changed)


# ------------------------------------------------------------------------------------- planted bugs

def _no_rollback(monkeypatch):
    """The verify's states kept as they are, rejected drafts included (the merged rule's roll does nothing)."""

    def keep(self, dec, before, tokens, kept, width, starts):
        dec.state.carry = None

    monkeypatch.setattr(Merged, "roll", keep)


def _one_position_off(monkeypatch):
    """The replay runs one accepted token too few."""
    replay = Replay.replay

    def off_by_one(self, cache, before, tokens, short, starts, pads, stats):
        return replay(self, cache, before, tokens, {b: a - 1 if a > 1 else a for b, a in short.items()}, starts,
                      pads, stats)

    monkeypatch.setattr(Replay, "replay", off_by_one)


def _rows_mixed(monkeypatch):
    """A restore gives row 0's states to row 1 too."""
    restore = LinearStates.restore

    def mixed(self, checkpoint):
        restore(self, checkpoint)
        for *_, state in _states(self.layers):
            state[1].copy_(state[0])

    monkeypatch.setattr(LinearStates, "restore", mixed)


PLANTS = {"no rollback": (_no_rollback, "merged"), "one position off": (_one_position_off, "replay"),
          "a row's states given to another": (_rows_mixed, "merged")}


def _identical(target, ids: torch.Tensor, refs: torch.Tensor, rollback: str) -> bool:
    """Whether a batch of ``ids`` (B, P) decodes to ``refs`` (each row's own ``generate``) with a drafter right
    for 3 tokens then wrong (a rollback every step)."""
    out = SpeculativeGenerator(target, Oracle(refs), rollback=rollback).generate(ids, max_new_tokens=refs.shape[1] -
                                                                                 ids.shape[1])
    return torch.equal(out, refs)


@pytest.mark.parametrize("arch", FAMILIES)
def test_planted_rollback_bugs_fail_on_every_family(arch, monkeypatch):
    target = hybrid_target(arch)
    rng = random.Random(arch)
    ids = torch.cat([hybrid_prompt(rng, 10), hybrid_prompt(rng, 10)])
    refs = torch.cat([hf(target, row[None], 24) for row in ids])
    for rollback in ("merged", "replay"):
        assert _identical(target, ids, refs, rollback), (arch, rollback)
    for name, (plant, rollback) in PLANTS.items():
        with monkeypatch.context() as patch:
            plant(patch)
            assert not _identical(target, ids, refs, rollback), (arch, name)
