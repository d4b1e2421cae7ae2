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
import test_infer_classic
from conftest import record_drafts
from test_infer_classic import ARCHES3, _hf, _repetitive_prompt, _target
from test_infer_sampling import exact_law, joint_pvalue, sample_triples

from heads import build_head
from infer import Chain, SpeculativeGenerator
from infer.adaptive import AdaptiveLength
from infer.drafters import Sampling, make_drafter
from infer.hierarchical import HierarchicalDrafter
from infer.layer_skip import LayerSkipDrafter, calibrated_layers, calibration_path
from infer.lm_drafter import LMDrafter
from infer.ngram import NgramDrafter

small_pair = test_infer_classic.small_pair  # the fixture: a small target and a different draft LM


def _trained_like(head, seed: int = 0, scale: float = 0.3):
    """The head with its adapter moved off its layer-skip start (as training would)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.self_attn.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return head.eval()


def _drafters(arch: str, target):
    same = _target(arch)  # the target itself as draft LM: every draft accepted
    other = _target(arch, seed=7, num_layers=2)
    return {
        "early-exit-fresh": make_drafter(build_head("early-exit", target, exit_layer=2), target, Chain(3)),
        "early-exit": make_drafter(_trained_like(build_head("early-exit", target, exit_layer=3)), target, Chain(4)),
        "early-exit-confidence": make_drafter(_trained_like(build_head("early-exit", target, exit_layer=1)), target,
                                              Chain(5), confidence=0.3),
        "hier-self": HierarchicalDrafter(same, target, NgramDrafter(max_ngram=2, length=3), Chain(5)),
        "hier-other": HierarchicalDrafter(other, target, NgramDrafter(length=8), Chain(4)),
        "hier-adaptive": AdaptiveLength(HierarchicalDrafter(other, target, NgramDrafter(), Chain(16)), initial=2),
    }


@pytest.mark.parametrize("compile", [False, "eager"])  # eager: drafts at their own size; traced: padded to the budget
@pytest.mark.parametrize("arch", ARCHES3)
def test_greedy_matches_hf(arch, compile):
    target = _target(arch)
    rng = random.Random(arch)
    for name, drafter in _drafters(arch, target).items():
        gen = SpeculativeGenerator(target, drafter, compile=compile)
        drafts = record_drafts(drafter)
        for prompt_len, max_new in ((1, 1), (12, 30), (20, 7)):
            ids = _repetitive_prompt(rng, prompt_len)
            assert torch.equal(gen.generate(ids, max_new_tokens=max_new), _hf(target, ids, max_new)), (name, prompt_len)
            assert all(d.tokens.numel() <= drafter.max_nodes for d in drafts), name
            if name == "hier-self" and max_new == 30:  # 29 tokens after the first in 6 steps of <= 6
                assert gen.last_stats.tau > 4.8, gen.last_stats.tau
        assert drafts, name  # the recorder saw the drafts the checks above are about


@pytest.mark.parametrize("arch", ARCHES3)
def test_eos_stops_like_hf(arch):
    target = _target(arch)
    ids = _repetitive_prompt(random.Random(1), 10)
    eos = int(_hf(target, ids, 24)[0, 10 + 9])  # a token HF emits: generation must stop at its first occurrence
    ref = _hf(target, ids, 24, eos=eos)
    for name, drafter in _drafters(arch, target).items():
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=24, eos_token_id=eos),
                           ref), name


def test_fresh_early_exit_head_is_layer_skip():
    """o_proj starts at zero and the norm at the target's: a fresh head drafts what layer skip drafts
    with the same k; moving the adapter changes the drafts."""
    target = _target("qwen2")
    ids = _repetitive_prompt(random.Random(3), 14)
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


def test_early_exit_head_checks_its_layer():
    target = _target("llama")
    assert build_head("early-exit", target).config.exit_layer == 3  # half of 6
    for k in (0, 6):
        with pytest.raises(ValueError, match=f"exit_layer must lie in \\[1, 6 - 1\\].*got {k}"):
            build_head("early-exit", target, exit_layer=k)
    with pytest.raises(ValueError, match="feature layers"):
        build_head("early-exit", target, exit_layer=5).check_target(_target("llama", num_layers=4))
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
    target = _target("llama")
    ids = _repetitive_prompt(random.Random(6), 16)
    draft_lm = _target("llama", num_layers=4, seed=3)
    runs = {}
    for name, drafter in (("plain", LMDrafter(draft_lm, target, Chain(6))),
                          ("hier", HierarchicalDrafter(draft_lm, target, NgramDrafter(length=6), Chain(6)))):
        drafts = record_drafts(drafter)
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=30), _hf(target, ids, 30))
        runs[name] = [d.tokens.tolist() for d in drafts]
    assert runs["hier"] == runs["plain"]
    forwards = {}
    for name, cls in (("plain", LMDrafter), ("hier", HierarchicalDrafter)):
        stub = CycleLM(target, period=3)
        drafter = cls(stub, target, tree=Chain(12))
        drafts = record_drafts(drafter)
        assert torch.equal(SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=20), _hf(target, ids, 20))
        forwards[name] = (stub.forwards, [d.tokens.tolist() for d in drafts])
    assert forwards["hier"][1] == forwards["plain"][1]
    assert forwards["hier"][0] < 0.8 * forwards["plain"][0], forwards  # 99 against 150 when written


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


@pytest.mark.parametrize("name", ["early-exit", "hierarchical"])
def test_sampling_follows_the_target_law(small_pair, name):
    target, draft = small_pair
    drafter = (make_drafter(_early_exit(target), target, Chain(3)) if name == "early-exit"
               else HierarchicalDrafter(draft, target, NgramDrafter(max_ngram=2, length=3), Chain(3)))
    gen = SpeculativeGenerator(target, drafter)
    samples, forwards = sample_triples(gen, 2000, temperature=1.0)
    assert joint_pvalue(samples, exact_law(target, 1.0, 0, 1.0)) > 1e-3
    assert forwards < 2.99, forwards  # some drafts were accepted


def test_broken_inner_rule_is_detected(small_pair):
    target, _ = small_pair
    gen = SpeculativeGenerator(target, KeepsGuesses(target, target, NgramDrafter(max_ngram=2, length=3), Chain(3)))
    samples, _ = sample_triples(gen, 2000, temperature=1.0)
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
    from infer.bench.calibrate_layer_skip import calibrate_layer_skip

    target = _target("mistral")
    assert calibrated_layers(target) is None and LayerSkipDrafter(target).layers == 3  # default: half of 6
    prompts = [_repetitive_prompt(random.Random(i), 12)[0].tolist() for i in range(2)]
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
    other = _target("mistral", num_layers=4)  # another identity: another file
    assert calibration_path(other) != path and LayerSkipDrafter(other).layers == 2
    path.write_text(json.dumps({"best_layers": 6}))
    with pytest.raises(ValueError, match="best_layers=6 is not a layer count of this 6-layer target"):
        LayerSkipDrafter(target)
