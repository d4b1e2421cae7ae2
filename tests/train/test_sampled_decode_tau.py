"""Decode τ at a temperature > 0 (train/sampled_decode.py, ``train.eval_temperature``) is what the generator
measures on the same prompts and seeds, repeats from one evaluation to the next without moving the training's
random stream, carries an interval over the prompts (pooled counts), and is logged and chosen by under
``decode_tau_t<T>``; bad temperatures and a best_by naming an unlisted one are refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from support.copying import copying_eagle3, repeating_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.infer.drafters import adaptive_chain
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.seeded_decode import interval_sums, prompt_seed, seeded_generate, tau_interval
from draftsmith.train import decode_tau as dt
from draftsmith.train.config import ConfigError
from draftsmith.train.run import setup
from draftsmith.train.sampled_decode import sampled_row_counts

NEW_TOKENS = 40


def _decode_set(target, n: int = 4) -> dt.DecodeSet:
    prompts = [torch.randint(3, 96, (1, 6 + i), generator=torch.Generator().manual_seed(i)) for i in range(n)]
    return dt.DecodeSet(dt.greedy_continuations(target, prompts, NEW_TOKENS), NEW_TOKENS)


def _generator_counts(target, head, decode_set, temperature, seed=0):
    """The real generator drafting the head's adaptive chain (what decode τ measures at every temperature; the
    CPU default would choose lengths for this machine's speed at T > 0), each prompt after torch.manual_seed of
    its seed."""
    gen = SpeculativeGenerator(target, adaptive_chain(head, target))
    counts = []
    for row in decode_set.rows:
        prompt = row.sequence[:, :row.prompt_length]
        torch.manual_seed(prompt_seed(prompt, seed))
        gen.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=temperature)
        counts.append((gen.last_stats.steps, gen.last_stats.step_tokens))
    return counts


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_sampled_decode_tau_is_the_generators_on_the_same_seeds(temperature):
    target = repeating_target()
    head = copying_eagle3(target)
    decode_set = _decode_set(target)
    ours = sampled_row_counts(head, target, decode_set, temperature)
    assert ours == _generator_counts(target, head, decode_set, temperature)
    tau = sum(t for _, t in ours) / sum(s for s, _ in ours)
    assert tau > 1.5  # drafts are accepted: the comparison is not between two runs of plain decoding
    assert sampled_row_counts(head, target, decode_set, temperature, seed=1) != ours  # the seed matters
    other = 0.3 if temperature == 1.0 else 1.0  # and the temperature (this target's 0.7 samples as its 1.0 does)
    assert _generator_counts(target, head, decode_set, other) != ours


def test_two_evaluations_agree_and_leave_the_random_stream_alone():
    target = repeating_target()
    head = copying_eagle3(target)
    decode_set = _decode_set(target, 3)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sampled_row_counts(head, target, decode_set, 1.0)
    assert torch.equal(torch.get_rng_state(), state)
    assert sampled_row_counts(head, target, decode_set, 1.0) == first


def test_a_seeded_generate_is_the_seeded_call():
    target = repeating_target()
    head = copying_eagle3(target)
    gen = SpeculativeGenerator(target, head)
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = seeded_generate(gen, prompt, 3, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(prompt_seed(prompt, 3))
    assert torch.equal(out, gen.generate(prompt, max_new_tokens=12, temperature=1.0))


def test_the_interval_is_the_pooled_ratios_over_prompts():
    counts = [(10, 30), (20, 40), (5, 25), (8, 16)]
    tau, low, high = tau_interval(interval_sums(counts))
    assert tau == pytest.approx(111 / 43)  # tokens over steps, summed first (the mean of ratios is 2.875)
    residuals = [t - tau * s for s, t in counts]
    half = 1.959964 * (4 / 3 * sum(r * r for r in residuals)) ** 0.5 / 43
    assert (low, high) == (pytest.approx(tau - half), pytest.approx(tau + half))
    # processes add their sums: two shares give the whole's interval
    shares = [a + b for a, b in zip(interval_sums(counts[:1]), interval_sums(counts[1:]))]
    assert tau_interval(shares) == pytest.approx(tau_interval(interval_sums(counts)))
    assert tau_interval(interval_sums(counts[:1]))[1:] == (None, None)
    assert tau_interval(interval_sums([])) == (0.0, None, None)


def _evals(out):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tau" in r]


def test_training_reports_decode_tau_at_each_temperature_and_keeps_the_best_by_one(tiny_files, tmp_path, caplog):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "train.eval_temperature=[0,1]", "train.best_by=decode_tau_t1"))
    evals = _evals(out)
    assert len(evals) == 2
    for r in evals:
        assert r["best_by"] == "decode_tau_t1" and r["decode_steps_t1"] > 0 and r["decode_tokens_t1"] > 0
        assert r["decode_tau_t1"] == r["decode_tokens_t1"] / r["decode_steps_t1"]
        assert r["decode_tau_t1_low"] <= r["decode_tau_t1"] <= r["decode_tau_t1_high"]
        assert r["decode_tau_low"] <= r["decode_tau"] <= r["decode_tau_high"]
    best = json.loads((out / "best" / "eval.json").read_text())
    assert best["decode_tau_t1"] == max(r["decode_tau_t1"] for r in evals)
    assert any("decode tau T=1 " in m and "decode tau " in m for m in caplog.messages)
    # a head decoded at T = 1 alone: auto chooses by it
    only = tmp_path / "only"
    setup(tiny_config(tiny_files, only, "train.eval_temperature=1", "train.max_steps=6"))
    assert all("decode_tau" not in r and r["best_by"] == "decode_tau_t1" for r in _evals(only))


@pytest.mark.parametrize("overrides, said", [
    (["train.eval_temperature=[0,-1]"], "train.eval_temperature: -1.0 is no temperature"),
    (["train.eval_temperature=[0,.nan]"], "train.eval_temperature: nan is no temperature"),
    (["train.eval_temperature=[1,1]"], "lists a temperature twice"),
    (["train.eval_temperature=[]"], "give at least one temperature"),
    (["train.best_by=decode_tau_t0.7"], "train.best_by: 'decode_tau_t0.7' is none of auto, simulated_tau, decode_tau"),
    (["train.eval_temperature=1", "train.best_by=decode_tau"], "'decode_tau' is none of auto, simulated_tau, decode_tau_t1"),
])
def test_bad_temperatures_are_refused_in_one_line(tiny_files, tmp_path, overrides, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(".", r"\.")) as err:
        tiny_config(tiny_files, tmp_path / "run", *overrides)
    assert "\n" not in str(err.value)
