"""When to speculate: the per-batch-size plan (lookup, save/load, clear errors), the generator
following it (capped drafts; "off" decodes without drafting, still token-identical), the plan found
next to a head, and the calibration that writes it (its shape, not its timings)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from support.targets import make_tiny_target
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.bench.calibrate_speculation import calibrate
from draftsmith.infer.speculation_plan import PLAN_FILE, SpeculationPlan, choose_lengths, find_plan

VOCAB = 96


def _target():
    model = make_tiny_target("llama", dtype=torch.float32, initializer_range=0.3)
    model.generation_config.eos_token_id = None
    return model


def _alone(model, prompt, max_new):
    return hf_greedy(model, torch.tensor([prompt]), max_new)[0, len(prompt):]


def test_plan_lookup_and_choice():
    plan = SpeculationPlan({1: 4, 4: 2, 16: 0})
    assert [plan.length_for(b) for b in (1, 2, 4, 8, 16, 64)] == [4, 4, 2, 2, 0, 0]
    assert SpeculationPlan({2: 3}).length_for(1) == 3  # below every calibrated size: the smallest's
    rows = [{"batch_size": 1, "length": 0, "tokens_per_s": 10.0}, {"batch_size": 1, "length": 3, "tokens_per_s": 25.0},
            {"batch_size": 8, "length": 0, "tokens_per_s": 50.0}, {"batch_size": 8, "length": 3, "tokens_per_s": 40.0},
            {"batch_size": 8, "length": 1, "tokens_per_s": 50.0}]
    assert choose_lengths(rows) == {1: 3, 8: 0}  # a tie goes to the shorter draft


def test_plan_save_load_and_errors(tmp_path):
    plan = SpeculationPlan({1: 3, 8: 0}, [{"batch_size": 1, "length": 3, "tokens_per_s": 1.0}])
    path = plan.save(tmp_path / PLAN_FILE)
    assert SpeculationPlan.load(path) == plan and find_plan(tmp_path) == plan
    assert find_plan(tmp_path / "elsewhere") is None
    bad = tmp_path / "bad.json"
    for text, match in (("{", "bad.json: not a speculation plan"), ('{"lengths": {"x": 1}}', "bad.json: not a"),
                        ('{"lengths": {"2": -1}}', "bad.json: .*draft length -1 for batch size 2"),
                        ('{"lengths": {"0": 1}}', "bad.json: .*batch size 0"), ('{"lengths": {}}', "at least one"),
                        # the same batch size twice: the later entry won without a word
                        ('{"lengths": {"1": 2, "01": 0}}', r"bad.json: batch size 1 is given more than once \('1', '01'\)"),
                        ('{"lengths": {"4": 2, "4": 0}}', "bad.json: not a speculation plan .*key '4' is given more than once")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            SpeculationPlan.load(bad)


def test_generator_follows_the_plan():
    """Batch size 1 drafts at most the plan's 2 levels; batch size 3 is 'off': no drafting at all
    (the drafter is never called, each step verifies one token per row); both token-identical."""
    model = _target()
    torch.manual_seed(0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 9, 3)]
    gen = SpeculativeGenerator(model, build_head("eagle", model), tree=Chain(4), plan=SpeculationPlan({1: 2, 3: 0}))
    calls = []
    propose = gen.drafter.propose_rows

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        calls.extend(out)
        return out

    gen.drafter.propose_rows = recording
    out = gen.generate(torch.tensor(prompts[:1]), max_new_tokens=16)
    assert torch.equal(out[0, 5:], _alone(model, prompts[0], 16))
    assert calls and max(d.tokens.numel() for d in calls) == 3  # root + 2 drafts, though the chain is 4
    calls.clear()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=12)
    for b, p in enumerate(prompts):
        assert torch.equal(out[b, width:], _alone(model, p, 12))
    stats = gen.last_stats
    assert not calls and stats.verified_tokens == stats.step_tokens == 3 * stats.steps  # one token per row per step


def test_from_pretrained_finds_the_plan_next_to_the_head(tmp_path):
    model = _target()
    model.save_pretrained(tmp_path / "target")
    head = build_head("eagle", model)
    head.save_pretrained(tmp_path / "head")
    assert SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), threads=1).plan is None
    SpeculationPlan({1: 2, 4: 0}).save(tmp_path / "head" / PLAN_FILE)
    gen = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), threads=1)
    assert gen.plan == SpeculationPlan({1: 2, 4: 0})
    json.loads((tmp_path / "head" / PLAN_FILE).read_text())  # plain JSON, readable by hand
    assert SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), threads=1,
                                                plan=None).plan is None  # an explicit None wins


def test_calibration_measures_every_cell_and_chooses_among_them():
    model = _target()
    torch.manual_seed(0)
    gen = SpeculativeGenerator(model, build_head("eagle", model), tree=Chain(3))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plan = calibrate(gen, prompts, [1, 2], [0, 1, 3], max_new_tokens=6, pad=0, warmup=0, repeats=1)
    assert [(r["batch_size"], r["length"]) for r in plan.measured] == [(b, n) for b in (1, 2) for n in (0, 1, 3)]
    assert plan.lengths == choose_lengths(plan.measured) and set(plan.lengths) == {1, 2}
    off = [r for r in plan.measured if r["length"] == 0]
    assert all(r["tau"] == r["verified_per_step"] == r["batch_size"] for r in off)  # one token per row per step
    assert gen.plan is None  # the generator's own plan is left as it was


def test_an_off_entry_decodes_with_the_default_adaptive_chain(tmp_path):
    """The plan calibrate_speculation.py writes, {"1": 0, "2": 2}, next to an EAGLE-3 head: on CPU the
    head's default drafter is the adaptive chain, whose state an "off" batch never makes (it ended in
    'NoneType' object has no attribute 'inner')."""
    model = _target()
    model.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    build_head("eagle3", model).save_pretrained(tmp_path / "head")
    (tmp_path / "head" / PLAN_FILE).write_text('{"lengths": {"1": 0, "2": 2}}')
    gen = SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), device="cpu",
                                               threads=1)
    assert type(gen.drafter).__name__ == "ByTemperature" and type(gen.drafter.greedy).__name__ == "AdaptiveLength"
    prompt = [5, 6, 7, 8]
    out = gen.generate(torch.tensor([prompt]), max_new_tokens=10)
    assert torch.equal(out[0, 4:], _alone(model, prompt, 10))
    assert gen.last_stats.verified_tokens == gen.last_stats.steps  # off: one token per step
    ids = torch.tensor([prompt, [9, 10, 11, 12]])
    out = gen.generate(ids, max_new_tokens=10)  # batch size 2: drafts of at most 2 levels
    assert torch.equal(out[1, 4:], _alone(model, [9, 10, 11, 12], 10))
