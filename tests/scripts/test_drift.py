"""scripts/drift.py: τ of one head on its own target and on a changed one, and the refresh advice."""
from __future__ import annotations

import json

import pytest
import torch
from support.peft_targets import save_adapter
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.data.targets import load_target, load_target_tokenizer
from draftsmith.scripts.drift import agreement, main
from draftsmith.train.run import setup

ARGS = ["--num-prompts", "3", "--prompt-tokens", "16", "--max-new-tokens", "24", "--heldout-tokens", "256",
        "--threads", "1"]


def test_agreement_counts_tokens_before_the_first_difference():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert agreement([[1, 2], [5, 6]], [[1, 2], [0, 6]]) == 0.5


@pytest.mark.slow
def test_drift_reports_tau_lost_on_a_changed_target(tiny_files, tmp_path):
    run = setup(tiny_config(tiny_files, tmp_path / "run", "head.kind=medusa", "head.num_heads=2", "train.lr=1e-2",
                            "train.max_steps=12", "train.eval_every=0"))
    same = main(["--head", str(run.output_dir), "--target", str(tiny_files["target"]), *ARGS])
    assert same["greedy_agreement"] == 1.0 and same["tau_lost"] == 0 and not same["refresh"]
    assert same["targets"]["old"] == {**same["targets"]["new"], "target": same["targets"]["old"]["target"]}

    adapter_dir, _ = save_adapter(load_target(str(tiny_files["target"])), tmp_path / "peft", scale=1.0)
    load_target_tokenizer(str(tiny_files["target"])).save_pretrained(tmp_path / "peft/base")
    moved = main(["--head", str(run.output_dir), "--target", str(adapter_dir), *ARGS,
                  "--out", str(tmp_path / "drift.json")])
    assert moved["greedy_agreement"] < 1.0
    assert moved["targets"]["new"]["heldout_loss"] != moved["targets"]["old"]["heldout_loss"]
    assert moved["refresh"] == (moved["tau_lost"] >= 0.05)
    assert json.loads((tmp_path / "drift.json").read_text()) == moved
    old_tau, new_tau = moved["targets"]["old"]["tau"], moved["targets"]["new"]["tau"]
    assert torch.isclose(torch.tensor(moved["tau_lost"]), torch.tensor(1 - new_tau / old_tau), atol=1e-4)
