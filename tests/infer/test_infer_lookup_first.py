"""Prompt lookup first, a head otherwise (infer.drafters.free.lookup_first.LookupFirst): lossless (greedy identity
per row, the target's law when sampling), both sources really draft, and the head's deferred observe
leaves it where observing every step would."""
from __future__ import annotations

import random

import pytest
import torch
from support.batch import BATCH_ARCHES, batch_prompts, expected, left_pad, target

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.infer.drafters.free.lookup_first import LookupFirst
from draftsmith.infer.drafters.free.ngram import NgramDrafter


def _count_sources(drafter: LookupFirst) -> dict[str, int]:
    """How many drafts lookup and the inner drafter make from now on."""
    seen = {"lookup": 0, "inner": 0}
    lookup, inner = drafter.lookup.propose_rows, drafter.drafter.propose_rows

    def lookup_propose(*args, **kwargs):
        drafts = lookup(*args, **kwargs)
        seen["lookup"] += sum(draft.tokens.shape[0] - 1 >= drafter.min_lookup for draft in drafts)
        return drafts

    def inner_propose(*args, **kwargs):
        out = inner(*args, **kwargs)
        seen["inner"] += len(out)
        return out

    drafter.lookup.propose_rows, drafter.drafter.propose_rows = lookup_propose, inner_propose
    return seen


KINDS = {"eagle3": Chain(4), "eagle": DynamicTree(depth=3, top_k=2, total_tokens=6), "medusa": Chain(3),
         "dflash": Chain(3)}


# eager on every family; traced ("eager" backend, about 8x an eager case) on llama: the trace is the drafter's
@pytest.mark.parametrize("arch,kind,compile", [(a, k, False) for a in BATCH_ARCHES for k in KINDS]
                         + [("llama", k, "eager") for k in KINDS])
def test_greedy_rows_match_each_row_alone(arch, kind, compile):
    tree = KINDS[kind]
    model = target(arch)
    rng = random.Random(f"{arch}-{kind}")
    torch.manual_seed(rng.randrange(1000))
    head = build_head(kind, model, **({"block_size": 4} if kind == "dflash" else {}))
    drafter = LookupFirst(make_drafter(head, model, tree), NgramDrafter(max_ngram=3, length=5), min_lookup=2)
    seen = _count_sources(drafter)
    gen = SpeculativeGenerator(model, drafter, compile=compile)
    # traced: the batch only (each batch size is traced anew; the eager cases run the row alone too)
    for lengths in ([[3, 12, 7]] if compile else [[9], [3, 12, 7]]):
        prompts = batch_prompts(rng, lengths, repetitive=True)
        ids, mask = left_pad(prompts)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=20)
        assert torch.equal(out, expected(model, prompts, 20))
    assert seen["lookup"] > 0 and seen["inner"] > 0, seen  # both sources drafted, or the test proves little


def test_deferred_observe_equals_observing_every_step():
    """The head catches up in one forward on what it missed; its state is the one it has when it
    observes every step (fp64)."""
    model = target("llama").double()
    torch.manual_seed(0)
    head = build_head("eagle3", model).double().eval()
    alone = make_drafter(head, model, Chain(3))
    wrapped = LookupFirst(make_drafter(head, model, Chain(3)))
    (a,), (b,) = alone.new_rows([torch.tensor([[3]])], [64]), wrapped.new_rows([torch.tensor([[3]])], [64])
    feats = torch.randn(1, 11, model.config.hidden_size * len(head.feature_layer_ids), dtype=torch.float64)
    tokens = torch.randint(3, 90, (1, 11))
    with torch.inference_mode():
        for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 11)):
            alone.observe_rows([a], [feats[:, lo:hi]], [tokens[:, lo:hi]])
            wrapped.observe_rows([b], [feats[:, lo:hi]], [tokens[:, lo:hi]])
        assert b.inner.hidden is None  # nothing ran yet: four observes are pending
        wrapped._catch_up([b])
    assert b.tokens == [] and b.features == []
    torch.testing.assert_close(b.inner.hidden, a.hidden)
    assert b.inner.cache.row_lengths() == a.cache.row_lengths() == [11]
    root = torch.tensor(7)
    sampling = Sampling()
    with torch.inference_mode():
        assert torch.equal(alone.propose_rows([a], [root], sampling, [3])[0].tokens,
                           wrapped.propose_rows([b], [root], sampling, [3])[0].tokens)


@pytest.mark.slow
def test_sampling_follows_the_target_law():
    """The first three sampled tokens follow the target's law (chi-square), with lookup drafts
    (deterministic) and head drafts (their own q) both in play."""
    from support.sampling import exact_law, joint_pvalue, make_small_target, sample_triples

    model = make_small_target()
    torch.manual_seed(1)
    drafter = LookupFirst(make_drafter(build_head("eagle", model), model, Chain(2)), NgramDrafter(length=3), min_lookup=1)
    seen = _count_sources(drafter)
    gen = SpeculativeGenerator(model, drafter)
    sampling = {"temperature": 0.9, "top_k": 6}
    samples, _ = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, exact_law(model, 0.9, 6, 1.0)) > 1e-3
    assert seen["lookup"] > 0 and seen["inner"] > 0, seen


def test_bad_arguments_are_one_line():
    model = target("llama")
    head = make_drafter(build_head("eagle3", model), model, Chain(3))
    with pytest.raises(TypeError, match="LookupFirst wraps a drafter"):
        LookupFirst(build_head("eagle3", model))
    with pytest.raises(TypeError, match="looks up with an NgramDrafter"):
        LookupFirst(head, head)
    with pytest.raises(ValueError, match="min_lookup"):
        LookupFirst(head, min_lookup=0)
