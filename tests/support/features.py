"""Helpers moved out of tests/train/test_features.py (other test files share them; no tests here)."""
from __future__ import annotations

from pathlib import Path


QUICK = ["data.eval=null", "train.eval_every=0", "train.log_every=1"]


def losses(result) -> list[float]:
    return [r["loss"] for r in result.history if "loss" in r]


def config_file(cfg, path: Path) -> Path:
    """The run's resolved config as a YAML file (what dump_features reads with --config)."""
    path.write_text(cfg.to_yaml())
    return path
