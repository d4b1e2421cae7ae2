"""Training objectives: ``base`` (what every kind declares, and ``objective_class``), one module per head kind
(``<kind>.py``, its class named ``OBJECTIVE``) and, in ``variants/``, one per variant with a class of its own
(``<variant>.py``, a subclass of its kind's)."""
from __future__ import annotations

from draftsmith.train.objectives.base import HeadSetup, Objective, objective_class

__all__ = ["HeadSetup", "Objective", "objective_class"]
