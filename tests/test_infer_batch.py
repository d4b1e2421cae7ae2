"""Batched greedy speculative decoding (infer.batch): a left-padded batch of prompts of mixed
lengths gives, row by row, exactly what ``target.generate`` gives that row alone (EOS and budget
included); n-gram drafts are accepted on the way; what the batched path does not support yet
(sampling, drafters other than n-grams, streaming, right padding) is refused in one line."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_target

from heads import build_head
from infer import Chain, SpeculativeGenerator
from infer.batch import generate_batch
from infer.lm_drafter import LMDrafter
from infer.ngram import NgramDrafter

VOCAB = 48
PAD = 0
ARCHES3 = ("llama", "qwen2", "mistral")
MAX_NEW = 20


def _target(arch: str, init: float = 0.3, **kw):
    """init 0.3: a chaotic target (every row says something different); 0.02: one that falls into
    cycles, which the n-gram drafter predicts (drafts are accepted, so acceptance is exercised)."""
    model = make_tiny_target(arch, vocab_size=VOCAB, initializer_range=init, **kw)
    model.generation_config.eos_token_id = None
    return model


def _hf(model, ids, max_new, eos=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                          eos_token_id=eos, pad_token_id=PAD)


def _rows(target, rng: random.Random) -> list[list[int]]:
    """Four prompts of different lengths; the first and third repeat the target's own continuation
    (the n-gram drafter finds the text the target says again), the others are short and plain."""
    def plain(length):
        motif = [rng.randrange(3, VOCAB) for _ in range(4)]
        return [1] + [motif[i % 4] if rng.random() < 0.8 else rng.randrange(3, VOCAB) for i in range(length - 1)]

    def looped(length):  # random text (no motif for lookups to latch onto), the target's continuation, again
        base = torch.tensor([[1] + [rng.randrange(3, VOCAB) for _ in range(length - 1)]])
        return torch.cat([_hf(target, base, MAX_NEW + 4), base], dim=1)[0].tolist()

    return [looped(6), plain(3), looped(2), plain(1)]


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _assert_rows_match(target, rows, out, eos) -> int:
    """Each row of ``out`` is its prompt's HF continuation, then padding; returns the new tokens."""
    width = max(len(r) for r in rows)
    assert out.shape == (len(rows), width + MAX_NEW)
    total = 0
    for b, row in enumerate(rows):
        ref = _hf(target, torch.tensor([row]), MAX_NEW, eos)[0, len(row):]  # stops at EOS, as one row
        got = out[b, width:]
        assert torch.equal(got[: ref.numel()], ref), (b, got.tolist(), ref.tolist())
        assert (got[ref.numel():] == PAD).all(), (b, got.tolist())  # padded after EOS / budget
        total += ref.numel()
    return total


@pytest.mark.parametrize("init", [0.3, 0.02])
@pytest.mark.parametrize("batch", [1, 2, 4])
@pytest.mark.parametrize("arch", ARCHES3)
def test_batched_greedy_matches_hf_row_by_row(arch, batch, init):
    target = _target(arch, init)
    rows = _rows(target, random.Random(arch))[:batch]
    ids, mask = _left_pad(rows)
    gen = SpeculativeGenerator(target, NgramDrafter(max_ngram=3, length=5))
    # EOS: a token the first row emits early, so that row stops while the others go on.
    plain = _hf(target, torch.tensor([rows[0]]), MAX_NEW)[0, len(rows[0]):]
    for eos in (None, int(plain[4])):
        if batch == 1:
            out = generate_batch(gen, ids, mask, MAX_NEW, eos_token_id=eos)
        else:
            out = gen.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
        assert torch.equal(out[:, : ids.shape[1]], ids)
        new_tokens = _assert_rows_match(target, rows, out, eos)
        if eos is not None:
            assert out[0, ids.shape[1] + 5:].eq(PAD).all()  # the first row did stop early
        stats = gen.last_stats
        assert stats.target_forwards <= MAX_NEW  # one forward per step for all rows
        assert stats.new_tokens == new_tokens and stats.wall_time > 0
        if eos is None and init < 0.1:  # a cycling target: drafts are accepted, steps gain more than one token
            assert stats.tau > 1.5, stats.tau


def test_eager_attention_takes_the_batched_mask():
    target = _target("qwen2", attn_implementation="eager")
    rows = _rows(target, random.Random(5))
    ids, mask = _left_pad(rows)
    out = SpeculativeGenerator(target, NgramDrafter(length=3)).generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    _assert_rows_match(target, rows, out, None)


def test_padded_single_row_and_finished_rows_are_no_ops():
    """A padded row alone gives what it gives unpadded; a row whose budget is 1 finishes at the
    prefill and rides along without disturbing the others."""
    target = _target("llama")
    rows = _rows(target, random.Random(3))
    ids, mask = _left_pad(rows[1:2] + rows[:1])
    gen = SpeculativeGenerator(target, NgramDrafter(length=4))
    out = gen.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=MAX_NEW)  # padding: the batched path
    _assert_rows_match(target, rows[1:2], out[:, ids.shape[1] - len(rows[1]):], None)
    eos = int(_hf(target, torch.tensor([rows[1]]), 1)[0, -1])  # the short row's first token ends it
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    _assert_rows_match(target, rows[1:2] + rows[:1], out, eos)
    assert out[0, ids.shape[1] + 1:].eq(PAD).all()


def test_sampling_with_a_batch_is_refused():
    target = _target("llama")
    gen = SpeculativeGenerator(target, NgramDrafter())
    ids, mask = _left_pad([[1, 5, 6], [1, 7]])
    with pytest.raises(ValueError, match="temperature=0.7 with batch size 2 is not supported yet"):
        gen.generate(ids, attention_mask=mask, temperature=0.7)
    with pytest.raises(ValueError, match="streamer"):
        gen.generate(ids, attention_mask=mask, streamer=object())


@pytest.mark.parametrize("kind", ["lm", "eagle"])
def test_unsupported_drafter_is_refused_by_name(kind):
    target = _target("llama")
    if kind == "lm":
        gen, name = SpeculativeGenerator(target, LMDrafter(_target("llama", num_layers=2), target, Chain(3))), "LMDrafter"
    else:
        gen = SpeculativeGenerator(target, build_head("eagle", target))
        name = type(gen.drafter).__name__
    ids, mask = _left_pad([[1, 5, 6], [1, 7]])
    with pytest.raises(ValueError, match=f"batched decoding supports NgramDrafter only for now, got {name}"):
        gen.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_bad_batches_raise_one_line_errors():
    target = _target("llama", max_position_embeddings=64)
    gen = SpeculativeGenerator(target, NgramDrafter())
    ids, mask = _left_pad([[1, 5, 6], [1, 7]])
    cases = [
        (dict(attention_mask=mask.flip(-1)), "left-padded"),
        (dict(attention_mask=mask[:, 1:]), "shape"),
        (dict(attention_mask=mask * 2), "only 0 and 1"),
        (dict(attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]])), "row 1 of the batch is all padding"),
        (dict(attention_mask=mask, max_new_tokens=0), "max_new_tokens"),
        (dict(attention_mask=mask, max_new_tokens=62), "exceeds"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            gen.generate(ids, **kwargs)
    with pytest.raises(ValueError, match="vocabulary"):
        gen.generate(torch.tensor([[1, 5], [1, 200]]))
    with pytest.raises(ValueError, match="branches must be 1, got 2"):
        SpeculativeGenerator(target, NgramDrafter(branches=2)).generate(ids, attention_mask=mask)
