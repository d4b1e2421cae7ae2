"""The house's facts the tests share: where the repository is, and its folders in import order (each imports only
those before it; docs/design.md), and which of them the wheel installs."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("data", "heads", "target", "infer", "train", "scripts", "lab")
# What the wheel installs: every layer but lab/ (our own measurement harnesses, run from a clone)
INSTALLED = LAYERS[:-1]
