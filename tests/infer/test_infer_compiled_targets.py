"""Two targets compiled in one process each decode as their own ``generate`` does: every target's verify (and every
head's draft step) compiles its own copy of the step function (``infer.compiling.owned_copy``). Sharing one code
object, the second target's recompile made torch 2.13 evaluate the first target's guards against it and raise
``KeyError: 'rotary_emb'`` (LFM3 then Kimi-Linear, which has no rotary module), and ``'full_attention_inv_freq'``
(then Ling-3.0's bailing_hybrid).

Plant (made once, failed this test with the KeyError): ``compiled`` compiling ``fn`` itself instead of the owner's copy.
"""
from __future__ import annotations

import torch
from support.hybrids import make_tiny_hybrid
from support.reference import hf_greedy

from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.compiling import owned_copy
from draftsmith.infer.drafters.free.ngram import NgramDrafter


def test_targets_of_other_shapes_compile_one_after_another():
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    for family in ("lfm3", "kimi_linear", "bailing_hybrid"):
        model = make_tiny_hybrid(family)
        model.generation_config.eos_token_id = None
        gen = SpeculativeGenerator(model, NgramDrafter(), compile="eager")
        assert torch.equal(gen.generate(ids, max_new_tokens=8), hf_greedy(model, ids, 8)), family


def test_one_copy_per_owner_and_function():
    class Step:
        def run(self, x):
            return x + 1

    a, b, step = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), Step()
    first, again, other = owned_copy(step.run, a), owned_copy(step.run, a), owned_copy(step.run, b)
    assert first.__func__ is again.__func__ and first.__func__ is not other.__func__  # generators of one owner share
    assert first.__func__.__code__ is not Step.run.__code__ and first.__self__ is step and first(1) == 2
