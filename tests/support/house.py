"""The house's facts the tests share: where the repository is, and its library folders in import order (each
imports only those before it; docs/design.md)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("data", "heads", "target", "infer", "train", "scripts")
