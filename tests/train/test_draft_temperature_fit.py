"""The draft temperature per depth fitted on held-out rows (``train.draft_temperature``), stored in the head's
config by each evaluation, saved with the head and read by its drafter."""
from __future__ import annotations

import json

import torch
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from transformers import AutoModelForCausalLM

from draftsmith.heads import AutoHead
from draftsmith.infer import Chain
from draftsmith.infer.drafters import make_drafter
from draftsmith.train.draft_temperature import GRID, DraftTemperatureFit
from draftsmith.train.metrics import acceptance_rate
from draftsmith.train.run import setup


def test_the_fit_finds_the_temperature_that_turns_the_logits_into_the_law():
    """Logits that are the law's log sharpened x2 at depth 0 and flattened x0.5 at depth 1: the fit picks 2 and 0.5
    (there the survival chance is 1), 1 at a depth it never saw; its rates are acceptance_rate's."""
    g = torch.Generator().manual_seed(0)
    probs = (torch.randn(3, 50, 40, generator=g) * 2).softmax(-1)
    mask = torch.rand(3, 50, generator=g) > 0.3
    fit = DraftTemperatureFit(3, torch.device("cpu"))
    fit.add(0, 2 * probs.log(), probs, mask)
    fit.add(1, 0.5 * probs.log() + 3.0, probs, mask)  # a shift changes no law
    fit.add(2, probs.log(), probs, torch.zeros_like(mask))
    assert fit.best() == [2.0, 0.5, 1.0]
    rates = fit.rates([2.0, 1.0, 1.0])
    assert abs(rates[0] - 1) < 1e-6
    assert abs(rates[1] - float(acceptance_rate(0.5 * probs.log()[mask], probs[mask]).mean())) < 1e-6
    assert 2.0 in GRID and 0.5 in GRID and 1.0 in GRID


def test_each_evaluation_fits_it_and_the_saved_head_drafts_with_it(tiny_files, tmp_path):
    cfg = tiny_config(tiny_files, tmp_path / "run", "head.kind=eagle3", "head.ttt_steps=3", "train.labels=top1")
    result = setup(cfg)
    records = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "tau" in r]
    assert len(evals) == 2
    for record in evals:
        fitted = record["draft_temperature"]
        assert len(fitted) == 3 and all(s in GRID for s in fitted)
        # the fit's choice survives at least as often as the untempered law, depth by depth
        assert all(a >= b - 1e-9 for a, b in zip(record["sampled_accept"], record["sampled_accept_untempered"]))
    best = json.loads((result.output_dir / "best" / "eval.json").read_text())
    loaded = AutoHead.from_pretrained(result.output_dir / "best")
    assert loaded.config.draft_temperature == best["draft_temperature"]
    final = AutoHead.from_pretrained(result.output_dir)
    assert final.config.draft_temperature == evals[-1]["draft_temperature"]
    target = AutoModelForCausalLM.from_pretrained(tiny_files["target"])
    assert make_drafter(loaded, target, Chain(2)).draft_temperature == tuple(best["draft_temperature"])


def test_a_warm_start_carries_the_fit_until_its_own_evaluation(tiny_files, tmp_path):
    """``train.init_from`` a head with a fitted temperature: a run without held-out data (no evaluation to refit)
    saves the source's (plant: not carried, the head saved without one)."""
    source = setup(tiny_config(tiny_files, tmp_path / "a", "head.kind=eagle3", "head.ttt_steps=2", "train.max_steps=6"))
    fitted = AutoHead.from_pretrained(source.output_dir).config.draft_temperature
    assert fitted is not None and len(fitted) == 2
    warm = setup(tiny_config(tiny_files, tmp_path / "b", "head.kind=eagle3", "head.ttt_steps=2", "train.max_steps=2",
                             f"train.init_from={source.output_dir}", "data.eval=null"))
    assert AutoHead.from_pretrained(warm.output_dir).config.draft_temperature == fitted


def test_a_resumed_run_keeps_its_checkpoints_fit_until_its_own_evaluation(tiny_files, tmp_path):
    """``resume_from=latest`` after an evaluation: a run going on without another evaluation saves the fitted
    temperature of its checkpoint (plant: not restored, the head saved without one)."""
    args = ["head.kind=eagle3", "head.ttt_steps=2", "train.save_every=4", "train.eval_every=4"]
    setup(tiny_config(tiny_files, tmp_path / "run", *args, "train.max_steps=4"))
    saved = AutoHead.from_pretrained(tmp_path / "run").config
    assert saved.draft_temperature is not None
    resumed = setup(tiny_config(tiny_files, tmp_path / "run", *args, "data.eval=null", "train.max_steps=6",
                                "resume_from=latest"))
    assert AutoHead.from_pretrained(resumed.output_dir).config.draft_temperature == saved.draft_temperature
