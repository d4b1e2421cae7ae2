"""Compiled drafting: with ``compile`` set, EAGLE and EAGLE-3 greedy chains draft through one
fixed-shape function (``EagleDrafter._fixed_levels`` over ``SlotWrites``: every step the same shapes,
whatever the rows' lengths) and DFlash's block pass reads the whole context buffers
(``DFlashDrafter._block_logits`` over ``StaticHeadCache.buffers``), traced here with dynamo's CPU
backends. Lossless (per-row greedy identity with ``target.generate``), the same drafts as the eager
path (fp64), and really used."""
from __future__ import annotations

import random

import pytest
import torch
from support.batch import BATCH_ARCHES, batch_alone, batch_prompts, expected, left_pad, target

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter


def _spy_fixed(drafter) -> list[int]:
    """Calls of the drafter's compiled draft from now on (counted outside the compiled region)."""
    name = ("_fixed_block" if hasattr(drafter, "_block_logits") else
            "_fixed_tree" if isinstance(getattr(drafter, "option", None), DynamicTree) else "_fixed_chain")
    calls, fixed = [], getattr(drafter, name)
    assert fixed is not None, "the generator did not hand its compile switch to the drafter"

    def counting(*args):
        calls.append(1)
        return fixed(*args)

    setattr(drafter, name, counting)
    return calls


COMPILED_KINDS = ("eagle", "eagle3", "dflash", "eagle-tree", "eagle3-tree")


# aot_eager (dynamo + AOT autograd, the stricter trace): each kind once and each family once, so each compiled
# draft function on two families (``_fixed_levels``: llama eagle, mistral eagle3; ``_tree_levels``: qwen2 eagle3,
# mistral eagle; ``_block_logits``: qwen2 here, llama and mistral in test_dflash_infer.py); the plain "eager"
# backend (dynamo alone, a subset of what aot_eager traces) on llama's chain (its dynamic trees:
# test_infer_trained.py's eager-backend cases, against HF greedy). A trace's failures are a family's or a
# kind's: every kind on llama as well (4 more traced cases) and the eager backend on a tree repeated them
# (round 3: 11 traced cases -> 6).
TRACED = [("llama", "eagle"), ("qwen2", "dflash"), ("qwen2", "eagle3-tree"), ("mistral", "eagle3"),
          ("mistral", "eagle-tree")]
assert {a for a, _ in TRACED} == set(BATCH_ARCHES) and {k for _, k in TRACED} == set(COMPILED_KINDS)


@pytest.mark.parametrize("arch,kind,compile", [(a, k, "aot_eager") for a, k in TRACED]
                         + [("llama", "eagle3", "eager")])
def test_compiled_chains_match_each_row_alone(arch, kind, compile):
    model = target(arch)
    rng = random.Random(f"{arch}-{kind}-{compile}")
    torch.manual_seed(rng.randrange(100))
    head = build_head(kind.removesuffix("-tree"), model, **({"block_size": 6, "num_layers": 2} if kind == "dflash" else {}))
    tree = DynamicTree(depth=3, top_k=2, total_tokens=6) if kind.endswith("-tree") else Chain(4)
    gen = SpeculativeGenerator(model, head, tree=tree, compile=compile)
    calls = _spy_fixed(gen.drafter)
    # One batch size, so one trace per compiled function (each new batch size is traced anew, ~4 s here): a
    # one-token budget, then rows of different lengths with EOS in the last one
    for lengths, max_new, eos_row in (([6, 9, 2], 1, False), ([4, 12, 7], 20, True)):
        prompts = batch_prompts(rng, lengths)
        eos = int(batch_alone(model, prompts[-1], max_new)[5]) if eos_row else None
        ids, mask = left_pad(prompts)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
        assert torch.equal(out, expected(model, prompts, max_new, eos)), (lengths, max_new)
    assert len(calls) > 0  # the compiled chain drafted


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_fixed_shape_chain_drafts_what_the_eager_chain_drafts(kind):
    """Rows of different lengths in one head cache, fp64: the full-capacity masked chain (traced)
    proposes exactly the eager chain's tokens, and leaves the cache's lengths as they were."""
    model = target("llama").double()
    torch.manual_seed(3)
    head = build_head(kind, model).double().eval()
    eager, fixed = make_drafter(head, model, Chain(5)), make_drafter(head, model, Chain(5))
    fixed.compile_with("eager")
    width = (len(eager.aux_layer_ids) or 1) * model.config.hidden_size
    counts = [7, 2, 11]
    feats = [torch.randn(1, n, width, dtype=torch.float64) for n in counts]
    toks = [torch.randint(3, 90, (1, n)) for n in counts]
    roots = [torch.tensor(t) for t in (5, 9, 13)]
    drafts = []
    for drafter in (eager, fixed):
        states = drafter.new_rows([t[:, :1] for t in toks], [32, 32, 32])
        with torch.inference_mode():
            drafter.observe_rows(states, feats, toks)
            drafts.append(drafter.propose_rows(states, roots, Sampling(), [5, 3, 5]))
        assert states[0].cache.row_lengths() == counts
    for a, b in zip(*drafts):
        assert torch.equal(a.tokens, b.tokens)
    assert [d.tokens.numel() for d in drafts[1]] == [6, 4, 6]  # each row kept its own depth


def test_sampling_and_confidence_stay_eager():
    """The compiled chain is greedy only: sampling and a confidence stop draft eagerly (and stay lossless)."""
    model = target("qwen2")
    torch.manual_seed(0)
    head = build_head("eagle3", model)
    gen = SpeculativeGenerator(model, make_drafter(head, model, Chain(4), confidence=0.2), compile="aot_eager")
    calls = _spy_fixed(gen.drafter)
    prompts = batch_prompts(random.Random(2), [8])
    ids, _ = left_pad(prompts)
    assert torch.equal(gen.generate(ids, max_new_tokens=12), expected(model, prompts, 12))
    gen.generate(ids, max_new_tokens=6, temperature=0.8)
    assert calls == []


def test_a_head_step_over_slot_writes_equals_the_eager_step():
    """One head step for rows of different lengths: over the whole buffer with ``slot_mask`` (stale
    entries planted past each row) it equals the eager step over each row's own entries (fp64)."""
    from draftsmith.infer.cache import SlotWrites, StaticHeadCache, slot_mask

    model = target("mistral").double()
    torch.manual_seed(4)
    head = build_head("eagle3", model).double().eval()
    drafter = make_drafter(head, model, Chain(3))
    width = len(drafter.aux_layer_ids) * model.config.hidden_size
    counts = [5, 1, 8]
    caches = [StaticHeadCache(24, rows=3), StaticHeadCache(24, rows=3)]
    with torch.inference_mode():
        feats = torch.randn(3, 8, width, dtype=torch.float64)
        toks = torch.randint(3, 90, (3, 8))
        for cache in caches:
            drafter._batched_step(cache, head.project(feats), toks, counts)
        for layer in caches[1]._keys + caches[1]._values:  # garbage past every row: must stay unseen
            for b, n in enumerate(counts):
                layer[b, :, n + 1:] = 1e3
        hidden = torch.randn(3, 1, model.config.hidden_size, dtype=torch.float64)
        tok = torch.randint(3, 90, (3, 1))
        eager = drafter._batched_step(caches[0], hidden, tok)
        slots = torch.tensor(counts)[:, None]
        fixed = drafter._step(SlotWrites(caches[1], slots), hidden, tok, slots, slot_mask(slots, 24, hidden.dtype))
    torch.testing.assert_close(fixed, eager, rtol=1e-10, atol=1e-10)


def test_dflash_block_over_whole_buffers_equals_the_eager_block():
    """DFlash rows of different context lengths, fp64: the block read over the whole context buffers
    (stale entries planted past every row) gives the eager block's logits, hence its drafts."""
    model = target("qwen2").double()
    torch.manual_seed(5)
    head = build_head("dflash", model, block_size=5, num_layers=2).double().eval()
    drafter = make_drafter(head, model, Chain(4))
    width = len(drafter.aux_layer_ids) * model.config.hidden_size
    counts = [6, 2, 9]
    states = drafter.new_rows([torch.tensor([[3]])] * 3, [24, 24, 24])
    with torch.inference_mode():
        drafter.observe_rows(states, [torch.randn(1, n, width, dtype=torch.float64) for n in counts],
                             [torch.randint(3, 90, (1, n)) for n in counts])
        cache = states[0].cache
        for k, v in cache.buffers():
            for b, n in enumerate(counts):
                k[b, :, n:], v[b, :, n:] = 1e3, -1e3
        block = torch.tensor([[7, 95, 95, 95, 95], [8, 95, 95, 95, 95], [9, 95, 95, 95, 95]])
        starts = torch.tensor(counts)
        eager = drafter._block_logits(cache.context(), block, starts)
        whole = drafter._block_logits(cache.buffers(), block, starts)
    torch.testing.assert_close(whole, eager, rtol=1e-10, atol=1e-10)
    assert cache.buffers()[0][0].shape[2] > max(counts)  # the whole buffer really is wider


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_fixed_shape_trees_draft_what_the_eager_trees_draft(kind):
    """EAGLE-2 trees for rows of different prefix lengths and depth limits (fp64, peaked heads so
    masks and depths change trees): the fixed-shape levels over the whole cache (traced) give every
    row the eager tree, tokens and parents, and leave the cache's lengths as they were."""
    model = target("llama").double()
    torch.manual_seed(1)
    head = build_head(kind, model).double().eval()
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(10 if p.dim() > 1 else 1)
    tree = DynamicTree(depth=4, top_k=3, total_tokens=9)
    eager, fixed = make_drafter(head, model, tree), make_drafter(head, model, tree)
    fixed.compile_with("eager")
    width = (len(eager.aux_layer_ids) or 1) * model.config.hidden_size
    counts = [6, 2, 9, 4]
    feats = [torch.randn(1, n, width, dtype=torch.float64) for n in counts]
    toks = [torch.randint(3, 90, (1, n)) for n in counts]
    roots = [torch.tensor(10 + b) for b in range(4)]
    drafts = []
    for drafter in (eager, fixed):
        states = drafter.new_rows([t[:, :1] for t in toks], [20] * 4)
        with torch.inference_mode():
            drafter.observe_rows(states, feats, toks)
            drafts.append(drafter.propose_rows(states, roots, Sampling(), [4, 2, 3, 0]))
        assert states[0].cache.row_lengths() == counts
    for a, b in zip(*drafts):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.tree.parents, b.tree.parents)
    assert drafts[1][3].tokens.numel() == 1 and len({d.tokens.numel() for d in drafts[1]}) > 1


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_calls_of_other_lengths_reuse_the_trace(kind):
    """The head caches are sized as the target's (``buffer_size``: a power of two >= 256), so a call with
    another prompt length and budget runs the compiled draft already traced (an exact size per call traced
    it anew every call: 10 traces for one test's 8 calls)."""
    from torch._dynamo.utils import counters

    model = target("llama")
    torch.manual_seed(0)
    head = build_head(kind, model, **({"block_size": 4, "num_layers": 1} if kind == "dflash" else {}))
    gen = SpeculativeGenerator(model, head, tree=Chain(3), compile="eager")
    rng = random.Random(kind)
    gen.generate(torch.tensor([batch_prompts(rng, [5])[0]]), max_new_tokens=9)
    traced = counters["stats"]["unique_graphs"]
    for length, max_new in ((11, 20), (3, 31)):
        ids = torch.tensor([batch_prompts(rng, [length])[0]])
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), expected(model, [ids[0].tolist()], max_new))
    assert counters["stats"]["unique_graphs"] == traced, "a call of another length traced the draft again"
