"""Helpers moved out of tests/infer/test_infer_generator.py (other test files share them; no tests here)."""
from __future__ import annotations

from draftsmith.infer import DynamicTree, StaticTree


VOCAB = 96
# Small trees keep the CPU tests fast; each kind's CPU and accelerator defaults run too.
SMALL = {"medusa": StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
         "eagle": DynamicTree(depth=4, top_k=3, total_tokens=12),
         "eagle3": DynamicTree(depth=4, top_k=3, total_tokens=12)}


def hf_greedy(model, ids, max_new, eos=None):
    return model.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)


_DECODED: dict[tuple, tuple] = {}


def hf_greedy_once(model, ids, max_new, eos=None):
    """``hf_greedy``, computed once per (model, prompt, max_new, eos) in a process: the head kinds of a family
    decode the same prompts, and HF's references were ~40% of an eager greedy case."""
    key = (id(model), tuple(ids[0].tolist()), max_new, eos)
    if key not in _DECODED:
        _DECODED[key] = (model, hf_greedy(model, ids, max_new, eos))  # the model kept: its id stays its own
    return _DECODED[key][1]
