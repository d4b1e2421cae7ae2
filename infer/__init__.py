"""draftsmith inference: drafting, tree verification and lossless speculative generation.

The names below load on first use (PEP 562), so that ``python -m draftsmith.infer.generate_command`` checks its arguments
before torch and transformers load."""
from __future__ import annotations

import importlib

_EXPORTS = {"Chain": "draftsmith.infer.drafters", "DynamicTree": "draftsmith.infer.drafters", "Sampling": "draftsmith.infer.drafters",
            "StaticTree": "draftsmith.infer.drafters", "GenerationStats": "draftsmith.infer.decoding",
            "SpeculativeGenerator": "draftsmith.infer.generator"}

__all__ = ["Chain", "DynamicTree", "GenerationStats", "Sampling", "SpeculativeGenerator", "StaticTree"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
