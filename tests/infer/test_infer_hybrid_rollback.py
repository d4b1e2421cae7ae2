"""A hybrid target's three rollbacks after a partial accept (docs/hybrid.md): "recorded" (the verify keeps every
position's states; each row keeps its accepted one's), "merged" (the states go back to before the step; the
accepted tokens run again in front of the next verify's draft) and "replay" (one more forward over them at once).
Greedy output equals ``target.generate`` of each row alone under each, on the
issue's four families: one row, left-padded batches of rows of different lengths whose rows accept the same
count (the merged path with B > 1) or not (its fallback), EOS mid-batch, a prompt one longer than the draft,
n-grams and a head; the stats show which path ran. Planted bugs fail the same checks: pending tokens missing
the first or the last accepted token, the restore skipped, the recorded states kept one token short or not at
all, or only the conv window or only the recurrent matrix kept one short."""
from __future__ import annotations

import functools
import random
from collections.abc import Iterator

import pytest
import torch
from support.infer_hybrid import MAIN, hybrid_prompt, hybrid_target, left_padded, perturbed
from support.oracle import Oracle
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.recurrent import LinearAttentionLayer, LinearStates
from draftsmith.infer.rollback import MAX_PENDING, Merged

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

MODES = ("recorded", "merged", "replay")


def _alone(target, rows: list[torch.Tensor], max_new: int, eos: int | None = None) -> list[torch.Tensor]:
    """Each row's own greedy text (prompt + continuation, cut after EOS)."""
    return [hf_greedy(target, r[None], max_new, eos=eos)[0] for r in rows]


def _mid_batch_eos(continuations: list[torch.Tensor]) -> int | None:
    """A token that ends row 1 mid-way (its first occurrence there at new token 6 or later) and that the
    other rows never emit, so they go on after row 1 stops."""
    others = set(torch.cat([c for i, c in enumerate(continuations) if i != 1]).tolist())
    row = continuations[1].tolist()
    return next((t for k, t in enumerate(row) if k >= 5 and t not in row[:k] and t not in others), None)


def _check_left_padded(out: torch.Tensor, width: int, rows: list[torch.Tensor], alone: list[torch.Tensor]) -> None:
    for b, (r, expected) in enumerate(zip(rows, alone)):
        new = expected[r.numel():]
        assert torch.equal(out[b, width: width + new.numel()], new), b
        assert bool((out[b, width + new.numel():] == 0).all()), b


@functools.cache
def _one_row_refs(arch: str) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """(prompt, new tokens, the target's own text) of one row, once per family for both rollbacks. 40 new tokens
    after the long prompt (were 60): 10 steps, the pending tokens still reach the cap and are replayed (asserted);
    the no-rollback plant fails every case at either length."""
    target, rng = hybrid_target(arch), random.Random(arch)
    return [(ids, n, hf_greedy(target, ids, n)) for ids, n in ((hybrid_prompt(rng, 14), 40), (hybrid_prompt(rng, 5), 30))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", MAIN)
def test_one_row_is_lossless_under_both_rollbacks(arch, mode):
    """A partial accept at every step (pending tokens pile up to ``MAX_PENDING``, then a replay), n-grams and
    a head; the prompt one longer than the oracle's draft (4 nodes: prompt 5)."""
    target = hybrid_target(arch)
    for ids, n, ref in _one_row_refs(arch):
        gen = SpeculativeGenerator(target, Oracle([ref[0]], right=3), rollback=mode)
        assert torch.equal(gen.generate(ids, max_new_tokens=n), ref), ids.shape[1]
        stats = gen.last_stats
        if mode == "merged":  # the merged path ran: pending tokens re-verified, replays only past the cap
            assert stats.pending_tokens > 0 and 1 <= stats.replays < stats.steps // 2, stats
        elif mode == "recorded":  # nothing runs twice
            assert stats.pending_tokens == stats.replays == 0
            assert stats.verified_tokens == stats.num_draft_tokens + stats.steps
        else:
            assert stats.pending_tokens == 0 and stats.replays >= stats.steps - 2
        drafters = (NgramDrafter(max_ngram=3, length=5), perturbed(build_head("eagle3", target, aux_layer_ids=[0, 1, 2])))
        for drafter in drafters:
            assert torch.equal(SpeculativeGenerator(target, drafter, rollback=mode).generate(ids, max_new_tokens=n), ref)


@functools.cache
def _left_padded_case(arch: str) -> tuple[list[torch.Tensor], int, list[torch.Tensor]]:
    """(rows, EOS, each row's own text cut after EOS), once per family for both rollbacks."""
    target = hybrid_target(arch)
    for seed in range(7, 40):  # prompts whose row 1 has a token the other rows never emit
        rng = random.Random(seed)
        rows = [hybrid_prompt(rng, n)[0] for n in (13, 5, 9)]
        eos = _mid_batch_eos([a[r.numel():] for r, a in zip(rows, _alone(target, rows, 24))])
        if eos is not None:
            break
    return rows, eos, _alone(target, rows, 24, eos=eos)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", MAIN)
def test_left_padded_batch_is_each_row_alone(arch, mode):
    """Rows of different lengths, left-padded, one stopping at EOS mid-batch: with the oracle every live row
    accepts the same count (merged: the pending tokens of every row in one verify, B > 1), with n-grams and
    a head they disagree (merged falls back to a replay for that step)."""
    target = hybrid_target(arch)
    rows, eos, alone = _left_padded_case(arch)
    assert [a.numel() - r.numel() for r, a in zip(rows, alone)][1] < 24 <= min(a.numel() - r.numel()
                                                                                for r, a in zip(rows[::2], alone[::2]))
    ids, mask = left_padded(rows)
    drafters = (Oracle(alone, right=3), NgramDrafter(length=4), perturbed(build_head("eagle3", target, aux_layer_ids=[0, 1, 2])))
    for drafter in drafters:
        gen = SpeculativeGenerator(target, drafter, rollback=mode)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
        _check_left_padded(out, ids.shape[1], rows, alone)
        if mode == "merged" and isinstance(drafter, Oracle):
            assert gen.last_stats.pending_tokens > 0
        if mode == "recorded":  # rows keeping different counts need no replay either
            assert gen.last_stats.pending_tokens == 0 and gen.last_stats.replays == 0


def test_the_steps_driven_by_hand_and_a_reused_generator_equal_generate():
    """``start`` -> ``step`` ... -> ``finish`` with tokens pending between steps is ``generate``, and the next
    call on the same generator (its cache reused) starts clean: pending tokens never outlive a decode."""
    target = hybrid_target("qwen3_5_text")
    rng = random.Random(4)
    first, second = hybrid_prompt(rng, 9), hybrid_prompt(rng, 12)
    refs = [hf_greedy(target, ids, 30) for ids in (first, second)]
    gen = SpeculativeGenerator(target, Oracle([r[0] for r in refs], right=3), rollback="merged")
    assert gen.rollback.rule == "merged"
    dec = gen.start(first, max_new_tokens=30)
    pending = 0
    while not dec.finished:
        gen.step(dec)
        pending += dec.state.carry is not None
    assert pending > 0 and torch.equal(gen.finish(dec), refs[0])
    assert torch.equal(gen.generate(second, max_new_tokens=30), refs[1])
    assert torch.equal(gen.generate(first, max_new_tokens=30), refs[0])


def test_the_rollback_option_is_checked():
    target = hybrid_target("lfm2")
    with pytest.raises(ValueError, match="rollback must be 'recorded', 'merged', 'replay' or None, got 'undo'"):
        SpeculativeGenerator(target, NgramDrafter(), rollback="undo")
    for rule in ("recorded", "merged"):
        with pytest.raises(ValueError, match=f"rollback='{rule}' cannot run here: compile is on"):
            SpeculativeGenerator(target, NgramDrafter(max_ngram=3, length=4), compile="eager", rollback=rule)
    assert SpeculativeGenerator(target, NgramDrafter(max_ngram=3, length=4), compile="eager").rollback.rule == "replay"
    for arch in MAIN:  # every main family records where it runs eagerly
        assert SpeculativeGenerator(hybrid_target(arch), NgramDrafter()).rollback.rule == "recorded", arch
    # Gated DeltaNet on its chunked rule (per_token=False) keeps no per-position state: merged
    gdn = hybrid_target("qwen3_5_text")
    assert SpeculativeGenerator(gdn, NgramDrafter(), per_token=False).rollback.rule == "merged"
    with pytest.raises(ValueError, match="rollback='recorded' cannot run on Qwen3_5ForCausalLM: its recurrent"):
        SpeculativeGenerator(gdn, NgramDrafter(), per_token=False, rollback="recorded")
    # Jamba's mixers run per token (target.one_token): they record nothing, so merged
    assert SpeculativeGenerator(hybrid_target("jamba"), NgramDrafter()).rollback.rule == "merged"


# ------------------------------------------------------------------------------------- planted bugs

def _oracle_runs(arch: str, rollback: str = "merged") -> Iterator[tuple[torch.Tensor, torch.Tensor,
                                                                       SpeculativeGenerator]]:
    """(output, the target's own, generator) for three prompts, a partial accept at every step, each decoded when
    asked for (a planted run stops at the first prompt that shows the bug)."""
    target = hybrid_target(arch)
    for ids, ref in _oracle_refs(arch):
        gen = SpeculativeGenerator(target, Oracle([ref[0]], right=3), rollback=rollback)
        yield gen.generate(ids, max_new_tokens=48), ref, gen


@functools.cache
def _oracle_refs(arch: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The three prompts of ``_oracle_runs`` and the target's own 48 tokens after each, once per family."""
    target = hybrid_target(arch)
    prompts = [hybrid_prompt(random.Random(seed), 14) for seed in (2, 3, 4)]
    return [(ids, hf_greedy(target, ids, 48)) for ids in prompts]


def _all_equal(runs, pending: bool = False) -> bool:
    """Whether every run equals the target's own text, decoding no further than the first that does not (once
    one prompt shows a planted bug, the check has failed); ``pending``: each run decoded carried pending tokens
    (the merged path ran)."""
    for out, ref, gen in runs:
        assert not pending or gen.last_stats.pending_tokens > 0
        if not torch.equal(out, ref):
            return False
    return True


@functools.cache
def _clean_runs_equal(arch: str, rollback: str = "merged") -> bool:
    """``_all_equal(_oracle_runs(arch, rollback))`` with nothing planted, once per family and rollback (the
    planted tests of one family share it; each still runs its planted decode itself)."""
    return _all_equal(_oracle_runs(arch, rollback))


@pytest.mark.parametrize("arch", MAIN)
@pytest.mark.parametrize("bug", ["drop the root", "drop the last accepted token"])
def test_pending_tokens_off_by_one_are_caught(monkeypatch, arch, bug):
    """Planted bug: the pending tokens miss this step's root or its last accepted draft."""
    assert _clean_runs_equal(arch)
    roll = Merged.roll

    def planted(self, dec, before, tokens, kept, width, starts):
        if bug == "drop the root":  # tokens: the p tokens pending before this step, its root, its drafts
            p = 0 if dec.state.carry is None else dec.state.carry.tokens.shape[1]
            tokens = torch.cat([tokens[:, :p], tokens[:, p + 1:]], dim=1)
        kept = [max(k - 1, 0) for k in kept]
        return roll(self, dec, before, tokens, kept, width, starts)

    monkeypatch.setattr(Merged, "roll", planted)
    assert not _all_equal(_oracle_runs(arch), pending=True)


@pytest.mark.parametrize("mode", ["merged", "replay"])  # "recorded" restores nothing: its plants are below
def test_a_skipped_restore_is_caught(monkeypatch, mode):
    """Planted bug: the states are never put back to the checkpoint (they keep the rejected drafts, and merged
    runs the pending tokens through them twice). On Nemotron-H (Mamba-2): the tiny random Gated DeltaNet
    models' greedy text hardly depends on their older state (this bug went unseen there in three prompts),
    and LFM2's conv window (3 tokens) is rewritten whole by any run of 3 tokens, restored or not."""
    assert _clean_runs_equal("nemotron_h", mode)
    monkeypatch.setattr(LinearStates, "restore", lambda self, checkpoint: None)
    assert not _all_equal(_oracle_runs("nemotron_h", mode))


@pytest.mark.parametrize("arch", ["nemotron_h", "qwen3_5_text"])
@pytest.mark.parametrize("bug", ["one token short", "not kept", "conv one short", "recurrent one short"])
def test_recorded_states_kept_wrong_are_caught(monkeypatch, arch, bug):
    """Planted bugs in "recorded": every row keeps the states one token short of its accepted ones (both, or
    only the conv window, or only the recurrent matrix), or keeps the verify's (rejected drafts and all)."""
    assert _clean_runs_equal(arch, "recorded")
    keep = LinearStates.keep

    def planted(self, kept):
        if bug == "not kept":
            self.recorded = {}
            return None
        for key, positions in self.recorded.items():  # position t now holds t - 1's (the first kept as it was)
            if bug in ("one token short", f"{key[1]} one short"):
                dim = -1 if key[1] == "conv" else 1
                first, rest = positions.split([1, positions.shape[dim] - 1], dim=dim)
                self.recorded[key] = torch.cat([first, first, rest], dim=dim).narrow(dim, 0, positions.shape[dim])
        return keep(self, kept)

    monkeypatch.setattr(LinearStates, "keep", planted)
    assert not _all_equal(_oracle_runs(arch, "recorded"))


def test_pending_tokens_pile_up_to_the_cap_then_a_replay_flushes_them():
    """Every step accepting 3 of 4 drafts adds 4 pending tokens (the root and 3 drafts): they pile up to at
    most ``MAX_PENDING``, and the step that would pass it replays them instead."""
    target = hybrid_target("lfm2")
    ids = hybrid_prompt(random.Random(2), 14)
    ref = hf_greedy(target, ids, 64)
    gen = SpeculativeGenerator(target, Oracle([ref[0]], right=3), rollback="merged")
    dec = gen.start(ids, max_new_tokens=64)
    carried = []
    while not dec.finished:
        replays = dec.stats.replays
        gen.step(dec)
        carried.append(0 if dec.state.carry is None else dec.state.carry.tokens.shape[1])
        if dec.stats.replays > replays:  # a flush: nothing left pending
            assert carried[-1] == 0
    assert torch.equal(gen.finish(dec), ref)
    assert max(carried) <= MAX_PENDING and max(carried) > MAX_PENDING - 4 and gen.last_stats.replays >= 1
    assert carried[:4] == [4, 8, 12, 16][: len(carried[:4])]
