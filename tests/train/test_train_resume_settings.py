"""resume_from=latest (issue 22, C): a change to a setting the checkpoint fixes is refused, naming the
key and both values, and config.yaml never records a value that was not used; a finished run says
it is complete instead of evaluating and saving again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.train.checkpoint import CHECKPOINTS, COMPLETE
from draftsmith.train.config import ConfigError
from draftsmith.train.run import setup
from draftsmith.train.resume import RESUME_FIXED, RunComplete, latest_checkpoint

FAST = ["head.kind=medusa", "train.save_every=2", "train.eval_every=0", "data.eval=null", "train.warmup_steps=0",
        "train.keep_last_checkpoints=3"]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


def cut_run(tiny_files, out: Path, *extra: str) -> None:
    """A 4-step run that died after its step-2 checkpoint."""
    setup(tiny_config(tiny_files, out, *FAST, "train.max_steps=4", *extra))
    import shutil

    shutil.rmtree(out / CHECKPOINTS / "step-0000004")
    (out / ".draftsmith-run").write_text("{}")  # not finished: the process died before the end


def test_a_changed_learning_rate_is_refused_naming_key_and_values(tiny_files, tmp_path):
    out = tmp_path / "run"
    cut_run(tiny_files, out)
    before = snapshot(out)
    with pytest.raises(ConfigError, match=r"overwrite_output_dir=true") as refused:
        setup(tiny_config(tiny_files, out, *FAST, "train.max_steps=4", "resume_from=latest", "train.lr=1e-2",
                          "train.micro_batch_size=2"))
    assert "train.lr=0.003 in the checkpoint, 0.01 now" in str(refused.value)
    assert "train.micro_batch_size=4 in the checkpoint, 2 now" in str(refused.value)
    assert snapshot(out) == before  # config.yaml still records the values the checkpoint was trained with
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 3e-3


def test_a_setting_the_config_applies_is_taken_and_recorded(tiny_files, tmp_path):
    out = tmp_path / "run"
    cut_run(tiny_files, out)
    result = setup(tiny_config(tiny_files, out, *FAST, "train.max_steps=6", "train.max_grad_norm=1.0",
                               "resume_from=latest"))
    assert result.steps == 6
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["train"]["max_steps"] == 6 and recorded["train"]["max_grad_norm"] == 1.0
    saved = json.loads((latest_checkpoint(out) / COMPLETE).read_text())["state"]["settings"]
    assert set(saved) == set(RESUME_FIXED) and saved["train.lr"] == 3e-3


def test_resuming_a_finished_run_says_it_is_complete(tiny_files, tmp_path, capsys):
    out = tmp_path / "run"
    args = [*FAST, "train.max_steps=4"]
    setup(tiny_config(tiny_files, out, *args))
    before = snapshot(out)
    with pytest.raises(RunComplete, match=r"the run is complete \(step 4"):
        setup(tiny_config(tiny_files, out, *args, "resume_from=latest"))
    assert snapshot(out) == before  # nothing evaluated, saved or rewritten

    from draftsmith.train.train_head import cli

    overrides = [f"{k}={v}" for k, v in (a.split("=", 1) for a in
                                         [*tiny_config_args(tiny_files, out), *args, "resume_from=latest"])]
    assert cli(["--config", str(out / "config.yaml"), *overrides]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "the run is complete" in lines[-1] and sum("the run is complete" in line for line in lines) == 1
    assert snapshot(out) == before
    more = setup(tiny_config(tiny_files, out, *FAST, "train.max_steps=6", "resume_from=latest"))
    assert more.steps == 6  # asking for more steps continues the run


def tiny_config_args(files, out):
    return [f"target={files['target']}", f"data.train={files['train']}", f"output_dir={out}",
            f"cache_dir={out.parent / 'cache'}"]
