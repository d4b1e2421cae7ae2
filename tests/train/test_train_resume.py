"""Checkpoints: resume_from=latest continues exactly; NaN stops without losing the last checkpoint;
a checkpoint made for another target is refused."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from support.train_fixtures import save_tiny_target, tiny_config, tiny_files  # noqa: F401  (fixture)
from transformers import AutoTokenizer

import draftsmith.train.objectives.medusa

from draftsmith import train
from draftsmith.train.checkpoint import CheckpointError
from draftsmith.train.checkpoint import CHECKPOINTS
from draftsmith.train.divergence import DivergenceGuard, TrainingDiverged
from draftsmith.train.run import setup
from draftsmith.train.resume import latest_checkpoint, mark_run


@pytest.mark.parametrize("kind, extra", [
    ("eagle3", ["head.draft_vocab_size=96", "head.ttt_steps=2"]),
    ("eagle", []),  # feature noise must be reproduced too
])
def test_resume_latest_gives_the_same_weights(tiny_files, tmp_path, kind, extra):
    # 24 rows / 4 per micro-batch / 2 per step = 3 steps per epoch: step 4 resumes mid-epoch.
    args = [f"head.kind={kind}", *extra, "train.grad_accum_steps=2", "train.max_steps=8",
            "train.save_every=4", "train.eval_every=4", "train.keep_last_checkpoints=2"]
    out = tmp_path / "run"
    full = setup(tiny_config(tiny_files, out, *args))
    reference = {k: v.clone() for k, v in full.head.state_dict().items()}
    assert latest_checkpoint(out).name == "step-0000008"

    shutil.rmtree(out / CHECKPOINTS / "step-0000008")  # as if the run died after step 7 ...
    mark_run(out)  # ... before it finished: no completion record
    resumed = setup(tiny_config(tiny_files, out, *args, "resume_from=latest"))
    assert resumed.steps == 8
    weights = resumed.head.state_dict()
    assert all(torch.equal(reference[k], weights[k]) for k in reference), "resumed weights differ"

    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(8) == 2  # one train record and one eval record


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_files, tmp_path, monkeypatch):
    calls = {"n": 0}
    real_loss = train.objectives.medusa.medusa_loss

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        out = real_loss(*args, **kwargs)
        return out._replace(loss=out.loss * float("nan")) if calls["n"] == 5 else out

    monkeypatch.setattr(train.objectives.medusa, "medusa_loss", poisoned)
    out = tmp_path / "nan"
    cfg = tiny_config(tiny_files, out, "head.kind=medusa", "train.save_every=2", "train.max_steps=8")
    with pytest.raises(FloatingPointError, match=r"at step 5 is not finite.*step-0000004.*resume_from=latest"):
        setup(cfg)
    assert latest_checkpoint(out).name == "step-0000004"
    assert not (out / CHECKPOINTS / "step-0000005").exists()
    assert not (out / "model.safetensors").exists()  # no final head from a failed run

    monkeypatch.setattr(train.objectives.medusa, "medusa_loss", real_loss)
    resumed = setup(tiny_config(tiny_files, out, "head.kind=medusa", "train.save_every=2", "train.max_steps=8",
                                "resume_from=latest"))
    assert resumed.steps == 8 and all(torch.isfinite(p).all() for p in resumed.head.parameters())


def test_resume_refuses_a_checkpoint_of_another_target(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "head.kind=medusa", "train.max_steps=2", "train.save_every=2",
                      "train.warmup_steps=0", "train.eval_every=0", "data.eval=null"))
    other = save_tiny_target(tmp_path / "other", AutoTokenizer.from_pretrained(tiny_files["target"]), num_layers=4)
    cfg = tiny_config(tiny_files, out, "head.kind=medusa", "train.max_steps=4", "resume_from=latest",
                      f"target={other}")
    with pytest.raises(ValueError, match=r"target_num_layers: checkpoint 6 vs now 4"):
        setup(cfg)
    with pytest.raises(CheckpointError, match="not a complete training checkpoint"):
        setup(tiny_config(tiny_files, out, "head.kind=medusa", f"resume_from={tmp_path}"))


@pytest.mark.parametrize("kind, extra", [
    ("medusa", []),
    ("eagle", []),
    ("eagle3", ["head.draft_vocab_size=96", "head.ttt_steps=2"]),
])
def test_divergence_stops_every_kind_and_keeps_the_last_good_checkpoint(tiny_files, tmp_path, kind, extra):
    out = tmp_path / "diverge"
    # warm-up: step 1 runs at lr 0 (a good checkpoint), step 2 at 2.5e5
    args = [f"head.kind={kind}", *extra, "train.max_steps=12", "train.save_every=1", "train.warmup_steps=4",
            "train.eval_every=0", "data.eval=null", "train.keep_last_checkpoints=1", "train.lr=1e6"]
    with pytest.raises(TrainingDiverged, match=r"at step (\d+)") as caught:
        setup(tiny_config(tiny_files, out, *args))
    step = int(re.search(r"at step (\d+)", str(caught.value)).group(1))
    last = latest_checkpoint(out)
    assert last is not None and int(last.name.removeprefix("step-")) == step - 1
    assert str(last) in str(caught.value)
    assert not (out / "model.safetensors").exists()  # no final head from a failed run


def test_divergence_guard_rules():
    guard = DivergenceGuard()
    for step in range(1, 6):
        assert guard.check_step(step, loss=5.0 - 0.1 * step, grad_norm=2.0) is None
    assert guard.check_step(6, loss=4.0, grad_norm=2.0e2) is None  # a 100x spike passes
    assert "loss" in guard.check_step(7, loss=60.0, grad_norm=2.0)  # > 10x the first step's loss
    assert "grad norm" in guard.check_step(8, loss=4.0, grad_norm=3.0e3 * 2.0)
    assert "not finite" in guard.check_step(9, loss=float("nan"), grad_norm=2.0)
    assert guard.check_update(9, norm_before=10.0, norm_after=10.5) is None
    assert "weight norm" in guard.check_update(9, norm_before=10.0, norm_after=1e4)
    restored = DivergenceGuard()
    restored.load_state_dict(guard.state_dict())
    assert "loss" in restored.check_step(10, loss=60.0, grad_norm=2.0)


def test_resume_survives_a_cut_metrics_log_and_keeps_it(tiny_files, tmp_path, caplog):
    """A crash mid-write leaves metrics.jsonl with a cut last line: the resume names the file and the
    line, keeps the damaged file beside it, and the new log holds every step exactly once."""
    args = ["head.kind=medusa", "train.max_steps=6", "train.save_every=3", "train.eval_every=100"]
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *args))
    shutil.rmtree(out / CHECKPOINTS / "step-0000006")
    mark_run(out)
    log = out / "metrics.jsonl"
    first_steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    damaged = log.read_text() + '{"step": 7, "lo'  # the crash cut this record
    log.write_text(damaged)
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        setup(tiny_config(tiny_files, out, *args, "resume_from=latest"))
    assert re.search(r"metrics\.jsonl: line\(s\) \d+ are not metrics records", caplog.text)
    assert (out / "metrics.jsonl.damaged").read_text() == damaged
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == first_steps  # each step's records once, as the uninterrupted run wrote them
