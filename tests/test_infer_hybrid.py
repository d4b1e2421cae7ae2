"""Hybrid targets (Gated DeltaNet, Mamba-1/2 and short-conv layers beside attention): greedy speculative
output equals the target's own ``generate`` for every drafter and every hybrid family transformers can
build tiny, single rows and left-padded batches, EOS mid-batch, a prompt one longer than the draft, a
1,000-token run, eager and traced (padded-to-budget) verifies; sampling keeps the target's law (chi-square);
and the rollback is what makes it so: a state restored one position off, or a tree whose sibling branches
see each other's state updates, fails the same checks."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_target
from hybrids import HYBRIDS, make_tiny_hybrid
from test_infer_sampling import joint_pvalue

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.bench.batch import left_pad
from draftsmith.infer.drafters import Draft, Drafter, Sampling, chain_draft, make_drafter, root_only
from draftsmith.infer.drafters.hierarchical import HierarchicalDrafter
from draftsmith.infer.drafters.layer_skip import LayerSkipDrafter
from draftsmith.infer.drafters.lm_drafter import LMDrafter
from draftsmith.infer.drafters.lookup_first import LookupFirst
from draftsmith.infer.drafters.ngram import NgramDrafter
from draftsmith.infer.recurrent import LinearAttentionLayer
from draftsmith.infer.rollback import NoRollback, Replay
from draftsmith.infer.tree import tree_from_parents

# transformers >= 5.24 keeps every hybrid layer's state in one cache interface (LinearAttentionLayer)
pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

MAIN = ("qwen3_5_text", "qwen3_next", "lfm2", "nemotron_h")  # the four, every drafter on each
VOCAB = 96

_TARGETS: dict[tuple, torch.nn.Module] = {}


def _target(arch: str, seed: int = 0, **kw):
    key = (arch, seed, tuple(sorted(kw.items())))
    if key not in _TARGETS:  # built once per session: a tiny hybrid takes a second or two
        model = make_tiny_hybrid(arch, seed=seed, **kw)
        model.generation_config.eos_token_id = None
        _TARGETS[key] = model
    return _TARGETS[key]


def _hf(model, ids, max_new, eos=None, mask=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, do_sample=False,
                          max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)


def _prompt(rng: random.Random, length: int) -> torch.Tensor:
    motif = [rng.randrange(3, VOCAB) for _ in range(4)]
    return torch.tensor([[1] + [motif[i % 4] if rng.random() < 0.8 else rng.randrange(3, VOCAB)
                                for i in range(length - 1)]])


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) (B, P) of the 1-D prompts ``rows``, padded on the left with 0."""
    return left_pad([r.tolist() for r in rows], 0, torch.device("cpu"))


def _assert_each_row_alone(out: torch.Tensor, width: int, alone: list[torch.Tensor], arch: str) -> None:
    """Each row of a batch's output (B, width + new) holds that row's own continuation, then only pads."""
    for b, expected in enumerate(alone):
        assert torch.equal(out[b, width: width + expected.numel()], expected), (arch, b)
        assert bool((out[b, width + expected.numel():] == 0).all()), (arch, b)


def _perturbed(head, seed: int = 0, scale: float = 0.05):
    """A random head moved off its init everywhere (a fresh DFlash/EAGLE head drafts little variety)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return head.eval()


def _drafters(arch: str, target) -> dict:
    torch.manual_seed(0)
    eagle3 = _perturbed(build_head("eagle3", target, aux_layer_ids=[0, 1, 2]))
    drafters = {
        "ngram": NgramDrafter(max_ngram=3, length=5),
        "eagle3": eagle3,  # a head: the generator picks the hybrid default (the kind's adaptive chain)
        "eagle": _perturbed(build_head("eagle", target)),
        "medusa": _perturbed(build_head("medusa", target, num_heads=3)),
        "dflash": _perturbed(build_head("dflash", target, block_size=4, num_layers=1, mask_token_id=90), scale=0.3),
        "early-exit": make_drafter(_perturbed(build_head("early-exit", target, exit_layer=2)), target, Chain(3)),
        "layer-skip": None if arch == "zamba" else LayerSkipDrafter(target, k=2, tree=Chain(4)),  # refused there
        "lookup-first": LookupFirst(make_drafter(eagle3, target, Chain(3))),
        "lm-self": LMDrafter(target, target, Chain(4)),  # a hybrid draft LM: every draft accepted
        "lm-other": LMDrafter(_target(arch, seed=7), target, Chain(3)),  # a hybrid draft LM, most rejected
        "hierarchical": HierarchicalDrafter(make_tiny_target("llama", vocab_size=VOCAB, num_layers=2, seed=3), target,
                                            NgramDrafter(length=4), Chain(4)),
    }
    return {name: drafter for name, drafter in drafters.items() if drafter is not None}


DRAFTERS = ("ngram", "eagle3", "eagle", "medusa", "dflash", "early-exit", "layer-skip", "lookup-first", "lm-self",
            "lm-other", "hierarchical")


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("arch", MAIN)
def test_every_drafter_is_lossless_on_a_hybrid(arch, name):
    target = _target(arch)
    rng = random.Random(arch)
    prompts = [(_prompt(rng, 14), 40), (_prompt(rng, 1), 6)]
    gen = SpeculativeGenerator(target, _drafters(arch, target)[name])
    for ids, n in prompts:
        assert torch.equal(gen.generate(ids, max_new_tokens=n), _hf(target, ids, n)), ids.shape[1]


@pytest.mark.parametrize("arch", sorted(set(HYBRIDS) - set(MAIN)))
def test_every_hybrid_family_is_lossless(arch):
    """The other families (Falcon-H1, Bamba, Granite-4-H, Jamba, OLMo-hybrid, Lara, Qwen3.5-MoE, LFM2-MoE, LFM3,
    Kimi-Linear, Ling-3.0 (Bailing-hybrid), Zamba, Zamba2): n-grams under both rollbacks and a head, on one
    row and on a prompt one longer than the head's first chain (4); a left-padded batch of rows of different
    lengths with one stopping at EOS mid-batch equals each row alone."""
    target = _target(arch)
    rng = random.Random(arch)
    head = _perturbed(build_head("eagle3", target, aux_layer_ids=[0, 1, 2]))
    for ids, n in ((_prompt(rng, 12), 32), (_prompt(rng, 5), 16)):
        ref = _hf(target, ids, n)
        for drafter, rollback in ((NgramDrafter(length=5), "merged"), (NgramDrafter(length=5), "replay"), (head, None)):
            out = SpeculativeGenerator(target, drafter, rollback=rollback).generate(ids, max_new_tokens=n)
            assert torch.equal(out, ref), (arch, ids.shape[1], type(drafter).__name__, rollback)
    rows = [_prompt(rng, n)[0] for n in (11, 4, 8)]
    eos = int(_hf(target, rows[1][None], 16)[0, rows[1].numel() + 5])  # row 1 stops at its 6th new token
    alone = [_hf(target, r[None], 16, eos=eos)[0, r.numel():] for r in rows]
    ids, mask = _left_padded(rows)
    out = SpeculativeGenerator(target, NgramDrafter(length=4)).generate(ids, attention_mask=mask, max_new_tokens=16,
                                                                         eos_token_id=eos, pad_token_id=0)
    _assert_each_row_alone(out, ids.shape[1], alone, arch)


@pytest.mark.parametrize("arch", sorted(set(HYBRIDS) - set(MAIN)))
def test_every_drafter_is_lossless_on_every_other_family(arch):
    """Every drafter (heads of each kind, n-grams, lookup-first, layer skip, hybrid draft LMs, hierarchical) on
    each family outside the four: one row of 14 tokens, 24 new (the four above run two prompts each)."""
    target = _target(arch)
    ids = _prompt(random.Random(arch), 14)
    ref = _hf(target, ids, 24)
    for name, drafter in _drafters(arch, target).items():
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=24), ref), (arch, name)


@pytest.mark.parametrize("compile", [False, "eager"])  # "eager": drafts padded to the budget, one shape
@pytest.mark.parametrize("arch", ["qwen3_5_text", "nemotron_h"])
def test_left_padded_batch_with_eos_equals_each_row_alone(arch, compile):
    """Rows of different lengths, left-padded: each row equals ``generate`` of that row alone (a pad
    never enters its recurrent state), a row stopping at EOS mid-batch while the others go on."""
    target = _target(arch)
    rng = random.Random(1)
    rows = [_prompt(rng, n)[0] for n in (15, 6, 11)]
    alone = [_hf(target, r[None], 24)[0, r.numel():] for r in rows]
    eos = int(alone[1][5])  # row 1 stops at its 6th new token
    alone = [_hf(target, r[None], 24, eos=eos)[0, r.numel():] for r in rows]
    ids, mask = _left_padded(rows)
    for drafter in (NgramDrafter(length=4), _perturbed(build_head("eagle3", target, aux_layer_ids=[0, 1, 2]))):
        out = SpeculativeGenerator(target, drafter, compile=compile).generate(
            ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos, pad_token_id=0)
        _assert_each_row_alone(out, ids.shape[1], alone, arch)


@pytest.mark.parametrize("arch", MAIN)
def test_prompt_one_longer_than_the_draft(arch):
    """The case engines got wrong (garbage when the prompt length is the draft length + 1)."""
    target = _target(arch)
    ids = _prompt(random.Random(5), 5)  # a chain of 4 drafts + 1
    ref = _hf(target, ids, 20)
    gen = SpeculativeGenerator(target, LMDrafter(_target(arch, seed=7), target, Chain(4)))
    assert torch.equal(gen.generate(ids, max_new_tokens=20), ref)


@pytest.mark.slow
def test_a_thousand_tokens_stay_exact():
    """Drift in a rolled-back state would compound: 1,000 tokens equal the target's with a partial accept
    (3 of 4 drafts) and a rollback at every step."""
    target = _target("qwen3_5_text", sharpen=4.0)
    ids = _prompt(random.Random(9), 10)
    ref = _hf(target, ids, 1000)
    gen = SpeculativeGenerator(target, Oracle(ref))
    assert torch.equal(gen.generate(ids, max_new_tokens=1000), ref)
    assert gen.last_stats.pending_tokens + gen.last_stats.replayed_tokens >= 3 * (gen.last_stats.steps - 1) > 600


class Oracle(Drafter):
    """Stub drafter that knows the target's greedy text ``ref`` (B, L), row b's in ``ref[b]``: a chain of
    ``good`` right tokens then a wrong one (a partial accept at every step), or with ``tree=True`` the
    root's two children, a wrong sibling first, then the right one and its right child."""

    aux_layer_ids = ()

    def __init__(self, ref: torch.Tensor, good: int = 3, tree: bool = False) -> None:
        self.refs, self.good, self.tree = ref, good, tree
        self.max_nodes = good + 2

    def new_rows(self, prompts, lengths):
        return [{"seq": p[0, :1], "ref": self.refs[b]} for b, p in enumerate(prompts)]

    def observe_rows(self, states, features, next_tokens):
        for state, tokens in zip(states, next_tokens):
            state["seq"] = torch.cat([state["seq"], tokens[0]])

    def propose_rows(self, states, roots, sampling: Sampling, max_depths: list[int]) -> list[Draft]:
        return [self._propose(s, r, d) for s, r, d in zip(states, roots, max_depths)]

    def _propose(self, state, root, max_depth: int) -> Draft:
        n = state["seq"].numel()
        right = state["ref"][n: n + min(self.good, max_depth)]
        if right.numel() < 2:
            return root_only(root)
        wrong = (right + 1) % VOCAB
        if self.tree:  # root -> wrong sibling, root -> right[0] -> right[1]
            return Draft(torch.stack([root, wrong[0], right[0], right[1]]), tree_from_parents([-1, 0, 0, 2]))
        return chain_draft([root, *right[:-1], wrong[-1]], [])


def test_a_state_restored_one_position_off_is_caught(monkeypatch):
    """Planted bug: the replay runs one accepted token too few; the identity check fails."""
    target = _target("qwen3_5_text")
    ids = _prompt(random.Random(2), 14)
    ref = _hf(target, ids, 40)
    assert torch.equal(SpeculativeGenerator(target, Oracle(ref), rollback="replay").generate(ids, max_new_tokens=40), ref)
    replay = Replay.replay

    def off_by_one(self, cache, before, tokens, short, starts, pads, stats):
        return replay(self, cache, before, tokens, {b: a - 1 if a > 1 else a for b, a in short.items()}, starts,
                      pads, stats)

    monkeypatch.setattr(Replay, "replay", off_by_one)
    assert not torch.equal(SpeculativeGenerator(target, Oracle(ref), rollback="replay").generate(ids, max_new_tokens=40),
                           ref)


def test_trees_are_refused_and_a_leaking_sibling_is_caught():
    """A tree's siblings would see each other's state updates in a recurrent layer: trees are refused on a
    hybrid in one line; verifying one anyway (the refusal and rollback planted away) breaks the identity."""
    target = _target("qwen3_5_text")
    ids = _prompt(random.Random(3), 14)
    ref = _hf(target, ids, 30)
    with pytest.raises(ValueError, match="hybrid.*chains"):
        SpeculativeGenerator(target, Oracle(ref, tree=True)).generate(ids, max_new_tokens=30)
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM is a hybrid.*not a DynamicTree"):
        SpeculativeGenerator(target, build_head("eagle3", target, aux_layer_ids=[0, 1, 2]), tree=DynamicTree())

    class Leaky(SpeculativeGenerator):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.rollback = NoRollback()  # no chain check, no rollback: the tree verified as one sequence

    assert not torch.equal(Leaky(target, Oracle(ref, tree=True)).generate(ids, max_new_tokens=30), ref)


def test_layer_skip_is_refused_on_zamba():
    """On the state-sensitive Zamba, layer skip's output differed from ``generate`` (k = 1, 2): refused."""
    with pytest.raises(ValueError, match=r"ZambaForCausalLM \(zamba\): layer skip is refused"):
        LayerSkipDrafter(_target("zamba"), k=2, tree=Chain(4))


def test_a_hybrid_draft_lm_is_refused_by_hierarchical_drafting():
    """Hierarchical rounds cut the draft LM's cache back mid-draft: a hybrid draft LM is refused in one line."""
    target = _target("qwen3_5_text")
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM keeps recurrent states: hierarchical drafting"):
        HierarchicalDrafter(_target("qwen3_5_text", seed=7), target, NgramDrafter(length=4), Chain(4))


@pytest.mark.parametrize("arch", ["lfm3", "qwen3_5_text"])
def test_a_draft_lms_cache_restores_exactly(arch):
    """A hybrid draft LM's cache (transformers' own, sliding-window layers included: LFM3's window is 8, and
    they drop their oldest entries as they grow) restored to a checkpoint and fed other tokens gives the
    logits of a fresh forward over the same text."""
    from transformers import DynamicCache

    from draftsmith.infer.recurrent import cache_checkpoint, restore_cache

    model = _target(arch)
    ids = _prompt(random.Random(4), 12)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        saved = cache_checkpoint(cache)
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache, use_cache=True)  # drafts past the window
        restore_cache(cache, saved)
        after = model(torch.tensor([[11, 12]]), cache=cache, use_cache=True).logits
        fresh = model(torch.cat([ids, torch.tensor([[11, 12]])], dim=1)).logits[:, -2:]
    torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------- sampling

SAMPLING_VOCAB = 8  # test_infer_sampling's joint_pvalue counts over 8 ** 3 cells
PROMPT = torch.tensor([[1, 5, 3]])


def _exact_law(model, temperature: float) -> torch.Tensor:
    """P(x1, x2, x3) (V, V, V) of the target's first three tokens at ``temperature`` (full forwards)."""
    import itertools

    v = SAMPLING_VOCAB
    with torch.no_grad():
        def law(contexts):
            return (model(contexts).logits[:, -1].double() / temperature).softmax(-1)

        p1 = law(PROMPT)[0]
        p2 = law(torch.cat([PROMPT.expand(v, -1), torch.arange(v)[:, None]], dim=1))
        pairs = torch.tensor(list(itertools.product(range(v), repeat=2)))
        p3 = law(torch.cat([PROMPT.expand(v * v, -1), pairs], dim=1)).view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2"])
def test_sampling_keeps_the_target_law_on_a_hybrid(arch):
    """Chi-square on the joint law of the first three tokens at T = 0.9, with a sampled chain from a
    hybrid draft LM (rejections resample from max(0, p - q) and roll the state back)."""
    target = make_tiny_hybrid(arch, seed=3, sharpen=6.0, vocab=SAMPLING_VOCAB)  # peaked enough to tell T apart
    draft = make_tiny_hybrid(arch, seed=4, sharpen=6.0, vocab=SAMPLING_VOCAB)
    target.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(target, LMDrafter(draft, target, Chain(2)))
    torch.manual_seed(0)
    samples = torch.stack([gen.generate(PROMPT, max_new_tokens=3, temperature=0.9)[0, 3:] for _ in range(1200)])
    law = _exact_law(target, 0.9)
    assert joint_pvalue(samples, law) > 1e-3
    wrong = _exact_law(target, 1.6)  # the harness can fail: the same samples against another law
    assert joint_pvalue(samples, wrong) < 1e-6
