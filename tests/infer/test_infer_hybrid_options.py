"""Every constructor option of ``SpeculativeGenerator`` keeps greedy output equal to the target's own ``generate``
on every hybrid family the tests build (those whose exactness rests on a routing among them: Jamba's and Zamba's
Mamba-1 mixers per token, Nemotron-H's and Zamba2's Mamba-2 scans without the dt clamp, Qwen3.5's Gated DeltaNet
rule), or is refused in one line.
``per_token=False`` chooses the Gated DeltaNet rule only: it once emptied the whole routing, and Jamba and
Zamba then decoded differently from ``generate`` without a word."""
from __future__ import annotations

import random

import pytest
import torch
from support.hybrids import HYBRIDS
from support.infer_hybrid import hybrid_prompt, hybrid_target
from support.oracle import Oracle
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.speculation_plan import SpeculationPlan
from draftsmith.target.delta_rule import per_token_modules
from draftsmith.target.recurrent import LAYER_KINDS, LinearAttentionLayer

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

FAMILIES = sorted(HYBRIDS)  # every hybrid family the tests build
# options that keep identity (greedy); those touching the verify and replay forwards also with per_token=False
ROUTING = {"defaults": {}, "rollback=replay": dict(rollback="replay"), "compile=eager": dict(compile="eager")}
OTHERS = {"rollback=merged": dict(rollback="merged"), "profile": dict(profile=True),
          "acceptance=typical": dict(acceptance="typical"), "plan": dict(plan=SpeculationPlan({1: 3})),
          "tokenizer": dict(tokenizer=object())}


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_option_keeps_greedy_identity(arch):
    """One prompt, 30 new tokens, an oracle drafter right for 3 tokens then wrong (a rollback at every step),
    under every option; with the Gated DeltaNet rule on and off where the option touches the routed forwards.
    (``tree``: a head's chain on a hybrid is tests/infer/test_infer_hybrid.py's; a custom drafter's is refused.)"""
    torch._dynamo.reset()  # compile=eager: each family starts from dynamo's empty cache, as one model in a process
    target = hybrid_target(arch)
    ids = hybrid_prompt(random.Random(f"options-{arch}"), 10)
    ref = hf_greedy(target, ids, 30)
    runs = [(name, dict(o, per_token=p)) for name, o in ROUTING.items() for p in (True, False)]
    for name, options in runs + list(OTHERS.items()):
        gen = SpeculativeGenerator(target, Oracle(ref), **options)
        assert torch.equal(gen.generate(ids, max_new_tokens=30), ref), (arch, name, options)


@pytest.mark.parametrize("arch", sorted(HYBRIDS))
def test_per_token_false_chooses_the_gated_deltanet_rule_only(arch):
    """On every family: per_token=False routes what per_token=True does, less the Gated DeltaNet modules."""
    target = hybrid_target(arch)
    on, off = (SpeculativeGenerator(target, Oracle(torch.zeros(1, 1)), per_token=p).per_token_modules
               for p in (True, False))
    kept = [r for r in on if not hasattr(r, "torch_chunk_gated_delta_rule")]
    assert list(off) == kept and bool(kept) == (LAYER_KINDS[arch] in ("Mamba-1", "Mamba-2")), (arch, on, off)
    assert bool(len(on) - len(off)) == (LAYER_KINDS[arch] == "Gated DeltaNet") and on == per_token_modules(target)


def test_options_that_cannot_keep_identity_are_refused_in_one_line():
    target = hybrid_target("nemotron_h")
    refused = {
        "per_token must be True or False, got 'no'": dict(per_token="no"),
        "rollback='merged' cannot run here: compile is on": dict(compile="eager", rollback="merged"),
        "acceptance must be one of": dict(acceptance="greedy"),
    }
    for message, options in refused.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")) as err:
            SpeculativeGenerator(target, Oracle(torch.zeros(1, 1)), **options)
        assert "\n" not in str(err.value), options
    with pytest.raises(ValueError, match="a custom drafter ignores `tree`"):
        SpeculativeGenerator(target, Oracle(torch.zeros(1, 1)), tree=Chain(3))
    # a head's tree on a hybrid: its recurrent layers read a verify as one sequence
    with pytest.raises(ValueError, match="chain") as err:
        SpeculativeGenerator(target, build_head("eagle3", target, aux_layer_ids=[0, 1, 2]), tree=DynamicTree())
    assert "\n" not in str(err.value)
