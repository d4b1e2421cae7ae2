"""Helpers moved out of tests/infer/test_infer_generator.py (other test files share them; no tests here)."""
from __future__ import annotations

from draftsmith.infer import DynamicTree, StaticTree


VOCAB = 96
# Small trees keep the CPU tests fast; each kind's CPU and accelerator defaults run too.
SMALL = {"medusa": StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
         "eagle": DynamicTree(depth=4, top_k=3, total_tokens=12),
         "eagle3": DynamicTree(depth=4, top_k=3, total_tokens=12)}
