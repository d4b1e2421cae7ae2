"""Training objectives: ``base`` (what every kind declares) and one module per head kind
(``<kind>.py``, its class named ``OBJECTIVE``)."""
from __future__ import annotations

import importlib

from draftsmith.train.objectives.base import HeadSetup, Objective


def objective_class(kind: str) -> type[Objective]:
    """The training objective of head kind ``kind`` (module ``train.objectives.<kind>``, ``-`` read as ``_``)."""
    from draftsmith.heads import HEAD_CLASSES

    if kind not in HEAD_CLASSES:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(HEAD_CLASSES)}")
    return importlib.import_module(f"draftsmith.train.objectives.{kind.replace('-', '_')}").OBJECTIVE


__all__ = ["HeadSetup", "Objective", "objective_class"]
