"""Decode τ (train/decode_tau.py) is the τ SpeculativeGenerator measures: per prompt, the same verification
steps and emitted tokens, for EAGLE-3 and every other kind, chains and trees, rows cut at EOS; it is reported
at every evaluation and chooses best/; where it cannot be computed the run says so and goes on."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from support.oracle import Oracle
from support.copying import copying_eagle3, repeating_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.heads import build_head
from draftsmith.infer.drafters import Chain, DynamicTree, make_drafter
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.train import decode_tau as dt
from draftsmith.train.evaluation import best_metric, decode_prompts
from draftsmith.train.run import setup
from draftsmith.train.unroll import unroll

NEW_TOKENS = 40


def _prompts(n: int = 4) -> list[torch.Tensor]:
    return [torch.randint(3, 96, (1, 6 + i), generator=torch.Generator().manual_seed(i)) for i in range(n)]


def _generator_counts(target, head, prompts, tree=None) -> list[tuple[int, int]]:
    """(verification steps, step tokens) of SpeculativeGenerator per prompt, each decoded alone, greedy."""
    gen = SpeculativeGenerator(target, head, tree=tree)
    counts = []
    for prompt in prompts:
        gen.generate(prompt, max_new_tokens=NEW_TOKENS)
        counts.append((gen.last_stats.steps, gen.last_stats.step_tokens))
    return counts


def _decode_counts(target, drafter, prompts) -> list[tuple[int, int]]:
    rows = dt.greedy_continuations(target, prompts, NEW_TOKENS)
    dt.with_features(target, rows, tuple(drafter.aux_layer_ids))
    return [dt.decode_counts(drafter, dt.DecodeSet([row], NEW_TOKENS)) for row in rows]


def _tau(counts) -> float:
    return dt.decode_tau(sum(s for s, _ in counts), sum(t for _, t in counts))


def test_decode_tau_is_the_generators_tau_for_an_eagle3_head_that_accepts():
    target = repeating_target()
    head = copying_eagle3(target)
    prompts = _prompts()
    drafter = dt.default_drafter(head, target)
    assert type(drafter.greedy).__name__ == "AdaptiveLength"  # the CPU default, greedy: the adaptive chain
    ours, theirs = _decode_counts(target, drafter, prompts), _generator_counts(target, head, prompts)
    assert ours == theirs
    assert _tau(ours) == _tau(theirs) > 3  # long accepted runs and short ones
    assert len({s for s, _ in ours}) > 1


def test_a_row_cut_at_eos_counts_as_the_generators():
    probe = repeating_target()
    prompt = _prompts(1)
    continuation = dt.greedy_continuations(probe, prompt, NEW_TOKENS)[0]
    eos = int(continuation.sequence[0, continuation.prompt_length + NEW_TOKENS // 2])  # a token it writes
    target = repeating_target(eos=eos)
    head = copying_eagle3(target)
    rows = dt.greedy_continuations(target, prompt, NEW_TOKENS)
    assert rows[0].sequence.shape[1] - rows[0].prompt_length <= NEW_TOKENS // 2 + 1  # cut after the EOS
    drafter = dt.default_drafter(head, target)
    assert _decode_counts(target, drafter, prompt) == _generator_counts(target, head, prompt)


@pytest.mark.parametrize("kind", ["eagle", "medusa", "dflash", "early-exit"])
def test_decode_tau_is_the_generators_tau_for_every_kind(kind):
    target = repeating_target()
    torch.manual_seed(0)
    head = build_head(kind, target).eval()
    prompts = _prompts(3)
    drafter = dt.default_drafter(head, target)
    assert dt.not_decodable(drafter) is None
    assert _decode_counts(target, drafter, prompts) == _generator_counts(target, head, prompts)


def test_a_wrong_draft_before_right_ones_accepts_none_as_the_generator():
    """Acceptance is a leading run: chains of a wrong draft and then the true tokens accept nothing, in decode tau as
    in the generator (tau 1.0); counting the drafts that match per position would accept the true ones."""
    target = repeating_target()
    prompts = _prompts(3)
    refs = [row.sequence[0] for row in dt.greedy_continuations(target, prompts, NEW_TOKENS)]
    counts = _decode_counts(target, Oracle(refs, shape="late", right=3), prompts)
    generator = SpeculativeGenerator(target, Oracle(refs, shape="late", right=3))
    theirs = []
    for prompt in prompts:
        generator.generate(prompt, max_new_tokens=NEW_TOKENS)
        theirs.append((generator.last_stats.steps, generator.last_stats.step_tokens))
    assert counts == theirs
    assert _tau(counts) == 1.0


def test_decode_tau_of_a_dynamic_tree_is_the_generators():
    target = repeating_target()
    head = copying_eagle3(target)
    tree = DynamicTree(depth=4, top_k=2, total_tokens=8)
    prompts = _prompts(3)
    counts = _decode_counts(target, make_drafter(head, target, tree), prompts)
    assert counts == _generator_counts(target, head, prompts, tree=tree)
    assert _tau(counts) > 1.5


def _attending_copier(target, norm_output: bool):
    """The copying head with a random attention output (o_proj at 0.3 of a unit scale): what it drafts now depends
    on what its attention reads (its cache of earlier positions, the RoPE positions, the mask)."""
    head = copying_eagle3(target, norm_output=norm_output)
    with torch.no_grad():
        weight = head.midlayer.self_attn.o_proj.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 0.3 / weight.shape[1] ** 0.5)
    return head


def _teacher_forced_walk(head, target, row: dt.DecodeRow, depth: int) -> tuple[list[tuple[int, int, int]], Tensor]:
    """A greedy decode read off training's unroll (train.unroll, teacher-forced, over the whole row at once): its
    steps as (root, accepted drafts, levels drafted), and the unroll's logits (depth, T, V). A step whose root is
    token r accepts the leading unroll steps at position r - 1 that draft the continuation's r + 1, r + 2, ..."""
    seq, p = row.sequence, row.prompt_length
    outs = unroll(head, head.project(row.features.float()), target.get_input_embeddings()(seq).float(), depth)
    logits = torch.stack([head.compute_logits(out).float()[0] for out in outs])  # (depth, T, Vd)
    top1 = head.draft_to_target(logits.argmax(-1))
    total, emitted, steps = seq.shape[1] - p, 1, []
    while emitted < total:
        root, levels = p + emitted - 1, min(depth, NEW_TOKENS - emitted - 1)
        wanted = seq[0, root + 1: root + 1 + levels]
        run = int((top1[: len(wanted), root - 1] == wanted).long().cumprod(0).sum())
        steps.append((root, run, levels))
        emitted += min(run + 1, total - emitted)
    return steps, logits


def _counts(steps) -> tuple[int, int]:
    """(steps, tokens) as decode_row counts them (each step emits its accepted drafts and the bonus)."""
    return len(steps), sum(run + 1 for _, run, _ in steps)


@pytest.mark.parametrize("norm_output", [False, True])
def test_a_decoded_chain_drafts_what_the_training_unroll_drafts(norm_output):
    """Training's teacher-forced unroll and the drafter compute the same thing: a greedy chain of the trained depth
    accepts, step by step, the unroll's drafts at the step's root, and every level it drafts on the accepted path
    (up to and with the first rejected draft) has the unroll's logits (docs/objectives.md, "Decoded against
    teacher-forced acceptance"). Planted: unroll's RoPE positions one later per step, its steps >= 1 blind to
    their own earlier entries, or the drafter's chain positions one later: each fails this."""
    target = repeating_target()
    head = _attending_copier(target, norm_output)
    rows = dt.greedy_continuations(target, _prompts(), NEW_TOKENS)
    dt.with_features(target, rows, tuple(head.feature_layer_ids))
    drafter = make_drafter(head, target, Chain(3))
    drafted, logits_of = [], drafter._logits
    drafter._logits = lambda hidden: drafted.append(logits_of(hidden)[0]) or drafted[-1][None]  # a recording spy
    compared = 0
    with torch.no_grad():
        for row in rows:
            drafted.clear()
            counts = dt.decode_row(drafter, row, NEW_TOKENS)
            steps, logits = _teacher_forced_walk(head, target, row, 3)
            assert counts == _counts(steps)
            assert len(drafted) == sum(levels for *_, levels in steps)
            levels_seen = 0
            for root, run, levels in steps:
                for k in range(min(run + 1, levels)):  # the accepted drafts and the first rejected one
                    torch.testing.assert_close(drafted[levels_seen + k], logits[k, root - 1], rtol=1e-5, atol=1e-5)
                    compared += k > 0
                levels_seen += levels
    assert compared > 20  # levels past the first, where the head reads its own output and its own cache entries


def _off_by_one(tokens, retrieve_indices, wanted):
    """A planted bug: drafts checked against the continuation one token late."""
    return _real_accepted(tokens, retrieve_indices, wanted[1:])


_real_accepted = dt.accepted_drafts


def test_the_check_fails_on_an_off_by_one(monkeypatch):
    """The checks can fail: with the drafts verified one token late the counts are no longer the generator's."""
    target = repeating_target()
    head = copying_eagle3(target)
    prompts = _prompts()
    theirs = _generator_counts(target, head, prompts)
    monkeypatch.setattr(dt, "accepted_drafts", _off_by_one)
    assert _decode_counts(target, dt.default_drafter(head, target), prompts) != theirs


def test_decode_prompts_end_before_the_first_trained_token_or_after_prompt_tokens():
    rows = [{"input_ids": [1, 5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1, 1]},  # a conversation: 3 prompt tokens
            {"input_ids": [1, 5, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 1, 1]},  # plain text: BOS, then trained
            {"input_ids": [1, 5, 6, 7], "loss_mask": [0, 1, 1, 1]},  # nothing after its 4 prompt tokens: passed over
            {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 0, 0]}]  # nothing trained: passed over
    prompts = decode_prompts(rows, rows=5, prompt_tokens=4)
    assert [p.tolist() for p in prompts] == [[[1, 5, 6]], [[1, 5, 6, 7]]]
    assert len(decode_prompts(rows, rows=1, prompt_tokens=4)) == 1
    assert [p.tolist() for p in decode_prompts(rows, rows=5, prompt_tokens=4, longest=3)] == [[[1, 5, 6]]]


def test_best_by():
    def cfg(best_by):
        return SimpleNamespace(train=SimpleNamespace(best_by=best_by, eval_temperature=[0.0]))

    assert best_metric(cfg("auto"), {"tau": 2.0, "decode_tau": 1.5}) == "decode_tau"
    assert best_metric(cfg("auto"), {"tau": 2.0}) == "tau"
    assert best_metric(cfg("simulated_tau"), {"tau": 2.0, "decode_tau": 1.5}) == "tau"
    assert best_metric(cfg("decode_tau"), {"tau": 2.0, "decode_tau": 1.5}) == "decode_tau"
    with pytest.raises(ValueError, match="no held-out prompt was decoded"):
        best_metric(cfg("decode_tau"), {"tau": 2.0})


def _evals(out) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tau" in r]


def test_training_reports_decode_tau_at_every_eval_and_keeps_the_best_by_it(tiny_files, tmp_path, caplog):
    out = tmp_path / "run"
    cfg = tiny_config(tiny_files, out, "train.eval_decode_rows=3", "train.eval_decode_tokens=16",
                      "train.eval_every=4")
    with caplog.at_level(logging.INFO, logger="draftsmith.train"):
        result = setup(cfg)
    evals = _evals(out)
    assert [r["step"] for r in evals] == [4, 8, 12]
    assert all(r["decode_tau"] >= 1 and r["best_by"] == "decode_tau" and r["decode_tokens"] > 0 for r in evals)
    assert all(r["decode_tokens"] <= 3 * 16 for r in evals)
    assert sum("decode tau" in m and "simulated tau" in m for m in caplog.messages) == 3  # the eval lines
    best = max(evals, key=lambda r: r["decode_tau"])  # the first of the best
    assert result.best_tau == best["decode_tau"]
    assert json.loads((out / "best" / "eval.json").read_text())["step"] == best["step"]
    assert "best head by decode τ" in (out / "README.md").read_text()


def test_no_decode_tau_when_off_and_best_by_simulated_tau(tiny_files, tmp_path):
    out = tmp_path / "run"
    result = setup(tiny_config(tiny_files, out, "train.eval_decode_rows=0", "train.max_steps=6"))
    evals = _evals(out)
    assert evals and all("decode_tau" not in r and r["best_by"] == "tau" for r in evals)
    assert result.best_tau == max(r["tau"] for r in evals)
    with pytest.raises(ValueError, match="train.best_by=decode_tau, but decode tau is not computed"):
        setup(tiny_config(tiny_files, tmp_path / "refused", "train.eval_decode_rows=0", "train.max_steps=6",
                          "train.best_by=decode_tau"))


def test_a_run_decode_tau_cannot_replay_says_so_once_and_trains_on(tiny_files, tmp_path, caplog):
    """Medusa-2 trains the target with the heads: its greedy text is not fixed, so decode τ is skipped."""
    out = tmp_path / "run"
    cfg = tiny_config(tiny_files, out, "head.kind=medusa", "train.backbone_lora_rank=2", "train.max_steps=6",
                      "train.eval_every=3")
    with caplog.at_level(logging.INFO, logger="draftsmith.train"):
        setup(cfg)
    said = [m for m in caplog.messages if "decode tau is not computed" in m]
    assert said == ["decode tau is not computed for head kind medusa: the target trains with the head "
                    "(train.backbone_lora_rank): its greedy text is not fixed"]
    assert all("decode_tau" not in r and r["best_by"] == "tau" for r in _evals(out))


def test_a_drafter_that_drafts_into_the_targets_cache_is_not_replayed():
    class SharesTheCache:
        entry_model = torch.nn.Identity()

    assert "drafts into the target's own cache" in dt.not_decodable(SharesTheCache())
