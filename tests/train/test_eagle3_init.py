"""EAGLE-3's start from the target's output layer (head.init_from_target) never starts training more
than FIRST_LOSS_BOUND worse than a random head, also on a target whose final-norm weights are large
(issue 22)."""
from __future__ import annotations

import shutil

import pytest
import torch
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from draftsmith.train.run import setup
from draftsmith.train.objectives.eagle3 import FIRST_LOSS_BOUND


def _first_loss(files, out, *extra) -> float:
    cfg = tiny_config(files, out, "head.kind=eagle3", "head.ttt_steps=3", "train.max_steps=1", "train.log_every=1",
                      "data.eval=null", "train.warmup_steps=0", *extra)
    return next(r["loss"] for r in setup(cfg).history if "loss" in r)


@pytest.mark.parametrize("norm_scale", [1.0, 30.0])
def test_init_from_target_starts_no_worse_than_random(tiny_files, tmp_path, norm_scale):
    files = dict(tiny_files)
    if norm_scale != 1.0:  # a target whose final norm weights are large (seen: mean 26, max 301)
        shutil.copytree(files["target"], tmp_path / "target")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
        with torch.no_grad():
            model.model.norm.weight.mul_(norm_scale)
        model.save_pretrained(tmp_path / "target")
        files["target"] = tmp_path / "target"
    copied = _first_loss(files, tmp_path / "copied", "head.init_from_target=true")
    random = _first_loss(files, tmp_path / "random", "head.init_from_target=false")
    assert copied <= random * FIRST_LOSS_BOUND * 1.01, (copied, random)  # 1.01: the first batch is not the probe
