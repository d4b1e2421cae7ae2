"""Self-speculation and hierarchical drafting through the one verify/accept loop: the early-exit head
(Kangaroo) and the draft LM whose drafts n-grams guess. Greedy output equals ``target.generate``
token for token; sampled chains keep the target's law (chi-square), and the test rejects a broken
inner rule; the layer-skip calibration file is found, and a bad one is refused."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from support import classic
from support.targets import record_drafts
from support.classic import ARCHES3, classic_target, hf, repetitive_prompt
from support.sampling import exact_law, joint_pvalue, sample_triples

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters import DynamicTree, Sampling, make_drafter
from draftsmith.infer.drafters.free.adaptive import AdaptiveLength
from draftsmith.infer.drafters.free.hierarchical import HierarchicalDrafter
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter, calibrated_layers, calibration_path
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter

small_pair = classic.small_pair  # the fixture: a small target and a different draft LM


def _trained_like(head, seed: int = 0, scale: float = 0.3):
    """The head with its adapter moved off its layer-skip start (as training would)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.self_attn.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return head.eval()


def _drafters(arch: str, target, n: int | None = None):
    """Every self-speculative drafter at its own size, or (``n``) each drafting at most n + 1 nodes, so one shape: a
    traced verify is traced once per budget, and the traced case traces once (were 4 budgets, 4 to 17 nodes)."""
    def chain(own: int) -> Chain:
        return Chain(own if n is None else n)

    same = classic_target(arch)  # the target itself as draft LM: every draft accepted
    other = classic_target(arch, seed=7, num_layers=2)
    deeper = classic_target(arch, seed=5, num_layers=4)  # room for EAGLE-3's three aux layers
    return {
        "early-exit-fresh": make_drafter(build_head("early-exit", target, exit_layer=2), target, chain(3)),
        "early-exit": make_drafter(_trained_like(build_head("early-exit", target, exit_layer=3)), target, chain(4)),
        "early-exit-confidence": make_drafter(_trained_like(build_head("early-exit", target, exit_layer=1)), target,
                                              chain(5), confidence=0.3),
        "hier-self": HierarchicalDrafter(same, target, NgramDrafter(max_ngram=2, length=3), chain(5)),
        "hier-other": HierarchicalDrafter(other, target, NgramDrafter(length=8), chain(4)),
        "hier-adaptive": AdaptiveLength(HierarchicalDrafter(other, target, NgramDrafter(), chain(16)), initial=2),
        # heads of the draft LM as the inner level (cut back with its cache on every rejection)
        "hier-eagle3": HierarchicalDrafter(deeper, target, _draft_lm_head("eagle3", deeper), chain(5)),
        "hier-dflash": HierarchicalDrafter(deeper, target, _draft_lm_head("dflash", deeper, length=2), chain(4)),
    }


def _draft_lm_head(kind: str, draft_lm, length: int = 3, seed: int = 0):
    """The drafter of a random ``kind`` head built on ``draft_lm`` (its target), guessing ``length``;
    every weight moved off its init (a fresh DFlash head guesses one token whatever its context)."""
    torch.manual_seed(seed)
    head = build_head(kind, draft_lm, **({"num_layers": 1} if kind == "dflash" else {})).eval().to(draft_lm.dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return make_drafter(head, draft_lm, Chain(length))


# eager: drafts at their own size, every family; traced ("eager" backend): padded to the budget, on llama (what
# a family changes, the caches, the eager cases prove; tracing repeated them for the other two), every drafter
# at one budget of 6 nodes (one trace; hier-self fills it, the rest stop short and are padded)
@pytest.mark.parametrize("arch,compile", [(a, False) for a in ARCHES3] + [("llama", "eager")])
def test_greedy_matches_hf(arch, compile):
    target = classic_target(arch)
    rng = random.Random(arch)
    # the same prompts and HF references for every drafter (HF decoded 24 references a case, now 3)
    cases = [(repetitive_prompt(rng, prompt_len), max_new) for prompt_len, max_new in ((1, 1), (12, 30), (20, 7))]
    cases = [(ids, max_new, hf(target, ids, max_new)) for ids, max_new in cases]
    padded = set()  # the drafters some of whose drafts stopped short of the budget
    for name, drafter in _drafters(arch, target, 5 if compile else None).items():
        gen = SpeculativeGenerator(target, drafter, compile=compile)
        drafts = record_drafts(drafter)
        for ids, max_new, ref in cases:
            assert torch.equal(gen.generate(ids, max_new_tokens=max_new), ref), (name, ids.shape[1])
            assert all(d.tokens.numel() <= drafter.max_nodes for d in drafts), name
            if name == "hier-self" and max_new == 30:  # 29 tokens after the first in 6 steps of <= 6
                assert gen.last_stats.tau > 4.8, gen.last_stats.tau
        assert drafts, name  # the recorder saw the drafts the checks above are about
        padded |= {name} if any(d.tokens.numel() < drafter.max_nodes for d in drafts) else set()
    assert len(padded) >= 5, padded  # most drafters' drafts stopped short (padded to the budget when traced)


@pytest.mark.parametrize("arch", ARCHES3)
def test_eos_stops_like_hf(arch):
    target = classic_target(arch)
    ids = repetitive_prompt(random.Random(1), 10)
    eos = int(hf(target, ids, 24)[0, 10 + 9])  # a token HF emits: generation must stop at its first occurrence
    ref = hf(target, ids, 24, eos=eos)
    for name, drafter in _drafters(arch, target).items():
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=24, eos_token_id=eos),
                           ref), name


def test_fresh_early_exit_head_is_layer_skip():
    """o_proj starts at zero and the norm at the target's: a fresh head drafts what layer skip drafts
    with the same k; moving the adapter changes the drafts."""
    target = classic_target("qwen2")
    ids = repetitive_prompt(random.Random(3), 14)
    runs = {}
    for name, drafter in (("layer-skip", LayerSkipDrafter(target, 2, Chain(3))),
                          ("fresh", make_drafter(build_head("early-exit", target, exit_layer=2), target, Chain(3))),
                          ("moved", make_drafter(_trained_like(build_head("early-exit", target, exit_layer=2), scale=1.0),
                                                 target, Chain(3)))):
        drafts = record_drafts(drafter)
        SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=20)
        runs[name] = [d.tokens.tolist() for d in drafts]
    assert runs["fresh"] == runs["layer-skip"]
    assert runs["moved"] != runs["layer-skip"]


def _layer_calls(target) -> list[int]:
    """Forward calls per decoder layer of ``target`` from now on (forward pre-hooks)."""
    calls = [0] * len(target.model.layers)
    for i, layer in enumerate(target.model.layers):
        layer.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("arch", ARCHES3)
def test_layer_skip_shares_its_kv_with_the_verify(arch):
    """Eager: the first k layers run in the draft only (the root and every draft of each step, the last
    one too) and layers k.. in the verify only; the target's cache ends holding what a verify through
    every layer writes (sharing off: the drafter's own cache), and both outputs are the target's own."""
    k, max_new = 2, 30
    ids = repetitive_prompt(random.Random(8), 12)
    ref = hf(classic_target(arch), ids, max_new)
    caches = {}
    for mode in ("shared", "own"):
        target = classic_target(arch)
        drafter = LayerSkipDrafter(target, k, Chain(4))
        if mode == "own":
            drafter.before_draft = lambda *args: None  # not told the target's cache: its own, every layer verified
        gen = SpeculativeGenerator(target, drafter)
        drafts = record_drafts(drafter)
        calls = _layer_calls(target)
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), ref), mode
        cache = gen._static_cache
        caches[mode] = cache.buffer[..., : cache.length, :].clone()
        steps = gen.last_stats.steps
        if mode == "shared":
            assert calls[k:] == [1 + steps] * (len(calls) - k)  # the prefill, then one verify per step
            assert calls[:k] == [1 + sum(d.tokens.numel() for d in drafts)] * k  # every node of every draft
            assert all(d.entry is not None and d.entry.shape[0] == d.tokens.numel() for d in drafts)
        else:
            assert calls[k:] == [1 + steps] * (len(calls) - k) and all(d.entry is None for d in drafts)
    torch.testing.assert_close(caches["shared"], caches["own"], rtol=1e-4, atol=1e-5)


class SlotOffByOne(LayerSkipDrafter):
    """A planted bug: the draft writes the first layers' KV one slot past where the verify reads them."""

    def before_draft(self, cache, lengths, pads):
        super().before_draft(cache, [n + 1 for n in lengths], [p + 1 for p in pads])


def test_layer_skip_kv_written_elsewhere_changes_the_output():
    target = classic_target("llama")
    rng = random.Random(9)
    wrong = 0
    for _ in range(4):
        ids = repetitive_prompt(rng, 12)
        wrong += not torch.equal(SpeculativeGenerator(target, SlotOffByOne(target, 2, Chain(4))).generate(
            ids, max_new_tokens=30), hf(target, ids, 30))
    assert wrong >= 1, wrong


def test_early_exit_head_checks_its_layer():
    target = classic_target("llama")
    assert build_head("early-exit", target).config.exit_layer == 3  # half of 6
    for k in (0, 6):
        with pytest.raises(ValueError, match=f"exit_layer must lie in \\[1, 6 - 1\\].*got {k}"):
            build_head("early-exit", target, exit_layer=k)
    with pytest.raises(ValueError, match="feature layers"):
        build_head("early-exit", target, exit_layer=5).check_target(classic_target("llama", num_layers=4))
    target.model.norm = torch.nn.LayerNorm(32)  # no per-channel scale for the head's norm to start from
    with pytest.raises(ValueError, match="not an RMS norm of the head's width; an early-exit head decodes"):
        build_head("early-exit", target)


class CycleLM(torch.nn.Module):
    """A stub draft LM whose greedy next token after t is (t + 1) mod ``period`` + 3: its drafts
    repeat, so n-gram guesses of them hold. Counts its forwards; keeps no KV (it needs none)."""

    def __init__(self, target, period: int) -> None:
        super().__init__()
        self.config, self.period, self.forwards = target.config, period, 0

    def forward(self, input_ids, position_ids, past_key_values, use_cache=True):
        self.forwards += 1
        nxt = (input_ids - 3 + 1) % self.period + 3  # (1, T)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.config.vocab_size).float() * 10)


def test_hierarchical_drafts_what_the_draft_lm_drafts_with_fewer_forwards():
    """Greedy: the chain is the draft LM's own, token for token (a real draft LM); when the n-gram
    guesses hold (a draft LM that repeats itself), the draft LM runs fewer forwards."""
    target = classic_target("llama")
    ids = repetitive_prompt(random.Random(6), 16)
    draft_lm = classic_target("llama", num_layers=4, seed=3)
    runs = {}
    for name, drafter in (("plain", LMDrafter(draft_lm, target, Chain(6))),
                          ("hier", HierarchicalDrafter(draft_lm, target, NgramDrafter(length=6), Chain(6)))):
        drafts = record_drafts(drafter)
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=30), hf(target, ids, 30))
        runs[name] = [d.tokens.tolist() for d in drafts]
    assert runs["hier"] == runs["plain"]
    forwards = {}
    for name, cls in (("plain", LMDrafter), ("hier", HierarchicalDrafter)):
        stub = CycleLM(target, period=3)
        drafter = cls(stub, target, tree=Chain(12))
        drafts = record_drafts(drafter)
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=20), hf(target, ids, 20))
        forwards[name] = (stub.forwards, [d.tokens.tolist() for d in drafts])
    assert forwards["hier"][1] == forwards["plain"][1]
    assert forwards["hier"][0] < 0.8 * forwards["plain"][0], forwards  # 99 against 150 when written


class FromScratch(HierarchicalDrafter):
    """Records each round's guesses beside those of a fresh inner state that reads the whole text so
    far at once: a head cut back wrongly (stale entries kept, or good ones dropped) guesses otherwise."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple[list[int], list[int]]] = []

    def _guesses(self, state, decided, pending, need):
        got = super()._guesses(state, decided, pending, need)
        text = state.cached if pending is None else torch.cat([state.cached, pending.reshape(1)])
        fresh = self.inner.new_rows([text[None, :1]], [text.numel() + 16])  # a batch of one
        self.inner.observe_rows(fresh, [state.feats[: text.numel() - 1][None]], [text[1:][None]])
        guessed, = self.inner.propose_rows(fresh, [text[-1]], Sampling(), [need])
        self.rounds.append((got.tolist(), guessed.tokens[1:].tolist()))
        return got


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "eagle"])
def test_inner_head_is_cut_back_with_the_draft_lm(kind):
    """Every round the inner head guesses exactly what a head reading the kept text from scratch guesses
    (fp64: incremental and whole-text features agree), across target rejections and rejected guesses;
    with a rewind that forgets nothing the guesses differ."""
    target = classic_target("llama").double()
    draft_lm = classic_target("llama", seed=5, num_layers=4).double()
    ids = repetitive_prompt(random.Random(2), 12)
    ref = hf(target, ids, 40)
    logs = {}
    for name in ("rewind", "no-rewind"):
        inner = _draft_lm_head(kind, draft_lm)
        if name == "no-rewind":
            inner.rewind_rows = lambda states, lengths: None  # the bug this test must catch: stale entries kept
        drafter = FromScratch(draft_lm, target, inner, Chain(5))
        gen = SpeculativeGenerator(target, drafter)
        assert torch.equal(gen.generate(ids, max_new_tokens=40), ref)  # lossless either way: guesses are only guesses
        logs[name] = drafter.rounds
    assert len(logs["rewind"]) > 15, len(logs["rewind"])
    assert all(got == want for got, want in logs["rewind"]), logs["rewind"]
    assert any(got != want for got, want in logs["no-rewind"])


def test_inner_level_is_checked():
    target, draft_lm = classic_target("llama"), classic_target("llama", seed=5, num_layers=4)
    with pytest.raises(ValueError, match="needs a head trained on the draft LM.*does not match"):
        HierarchicalDrafter(draft_lm, target, make_drafter(build_head("eagle3", classic_target("llama", num_layers=6,
                            hidden_size=48)), classic_target("llama", num_layers=6, hidden_size=48), Chain(3)), Chain(4))
    with pytest.raises(TypeError, match="cannot be the inner level"):
        HierarchicalDrafter(draft_lm, target, make_drafter(build_head("early-exit", draft_lm), draft_lm, Chain(3)), Chain(4))
    with pytest.raises(TypeError, match="guesses a Chain"):
        HierarchicalDrafter(draft_lm, target, _draft_lm_head("eagle3", draft_lm).__class__(
            _draft_lm_head("eagle3", draft_lm).head, draft_lm, DynamicTree(depth=2, top_k=2, total_tokens=4)), Chain(4))


# ------------------------------------------------------------------------------- sampling


def _early_exit(target, k=2):
    torch.manual_seed(0)
    return _trained_like(build_head("early-exit", target, exit_layer=k), scale=0.5)


class KeepsGuesses(HierarchicalDrafter):
    """A broken inner rule: a guess is always kept, yet q is reported: no longer lossless."""

    @staticmethod
    def _decide(logits, guess, sampling):
        q = sampling.probs(logits)
        return (guess, q) if guess is not None else (torch.multinomial(q, 1)[0], q)


# each drafter on one family, each family once: the sampling rule is the drafter's; the families' caches are
# the greedy tests' (every drafter x every family above)
@pytest.mark.parametrize("name,arch", [("early-exit", "llama"), ("hierarchical", "qwen2"),
                                       ("hierarchical-head", "mistral")])
def test_sampling_follows_the_target_law(arch, name):
    target, draft = classic.small_pair_of(arch)
    drafter = {"early-exit": lambda: make_drafter(_early_exit(target), target, Chain(3)),
               "hierarchical": lambda: HierarchicalDrafter(draft, target, NgramDrafter(max_ngram=2, length=3), Chain(3)),
               "hierarchical-head": lambda: HierarchicalDrafter(draft, target, _draft_lm_head("eagle", draft, 2), Chain(3)),
               }[name]()
    gen = SpeculativeGenerator(target, drafter)
    samples, forwards = sample_triples(gen, 2000, temperature=1.0)
    assert joint_pvalue(samples, exact_law(target, 1.0, 0, 1.0)) > 1e-3
    assert forwards < 2.99, forwards  # some drafts were accepted


def test_broken_inner_rule_is_detected(small_pair):
    target, _ = small_pair
    gen = SpeculativeGenerator(target, KeepsGuesses(target, target, NgramDrafter(max_ngram=2, length=3), Chain(3)))
    samples, _ = sample_triples(gen, 1000, temperature=1.0)  # p = 5e-66 at 1000 samples (seeded)
    assert joint_pvalue(samples, exact_law(target, 1.0, 0, 1.0)) < 1e-6


def test_inner_rule_keeps_the_draft_law():
    """The inner decision draws a token whose law is q, whatever the guess."""
    q_logits = torch.tensor([2.0, 0.5, 1.0, -1.0])
    q = q_logits.softmax(-1)
    torch.manual_seed(0)
    tokens = torch.stack([HierarchicalDrafter._decide(q_logits, torch.tensor(2), Sampling(1.0))[0] for _ in range(4000)])
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    assert (freq - q).abs().max() < 0.03, (freq, q)
    assert HierarchicalDrafter._decide(q_logits, torch.tensor(2), Sampling())[0] == 0  # greedy: the argmax


# ------------------------------------------------------------------------------- layer-skip calibration


def test_calibration_file_sets_the_default_k(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    from draftsmith.infer.bench.calibrate_layer_skip import calibrate_layer_skip

    target = classic_target("mistral")
    assert calibrated_layers(target) is None and LayerSkipDrafter(target).layers == 3  # default: half of 6
    prompts = [repetitive_prompt(random.Random(i), 12)[0].tolist() for i in range(2)]
    result = calibrate_layer_skip(target, prompts, [1, 4], depth=3, max_new_tokens=8)
    assert [r["layers"] for r in result["rows"]] == [1, 4] and result["vanilla_tokens_per_s"] > 0
    assert all(r["tau"] >= 1 and r["tokens_per_s"] > 0 and r["verify_s_per_step"] > 0 for r in result["rows"])
    assert result["best_layers"] == max(result["rows"], key=lambda r: r["tokens_per_s"])["layers"]
    path = calibration_path(target)
    assert path.parent == tmp_path / "layer-skip"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**result, "best_layers": 4}))
    drafter = LayerSkipDrafter(target)
    assert drafter.layers == 4 and drafter.calibrated
    assert LayerSkipDrafter(target, 2).layers == 2  # a given k wins
    other = classic_target("mistral", num_layers=4)  # another identity: another file
    assert calibration_path(other) != path and LayerSkipDrafter(other).layers == 2
    path.write_text(json.dumps({"best_layers": 6}))
    with pytest.raises(ValueError, match="best_layers=6 is not a layer count of this 6-layer target"):
        LayerSkipDrafter(target)
    path.write_text('{"best_layers": ')  # cut: it was json's message, naming no file
    with pytest.raises(ValueError, match=f"{path}: not a layer-skip calibration .*run scripts/calibrate_layer_skip.py"):
        LayerSkipDrafter(target)
