"""Exact against the target's own decode: a verify computes what ``generate``'s one-token steps compute, on
every family (Jamba's and Zamba's Mamba-1 and Zamba2's Mamba-2 only with their mixers run per token,
target/one_token.py); ``draftsmith check-target`` says so in one line and flags a target whose verify
disagrees; the generator says it when it meets an untested stateful family; 300 tokens stay exact, with the
per-token Gated DeltaNet rule engaged where the family has such layers."""
from __future__ import annotations

import functools
import random

import pytest
import torch
from support.hybrids import HYBRIDS
from support.infer_hybrid import Oracle, hf, hybrid_prompt, hybrid_target

import draftsmith.target.decode_check as decode_check
import draftsmith.target.one_token as one_token
import draftsmith.target.recurrent as recurrent
from draftsmith.infer import SpeculativeGenerator
from draftsmith.target.decode_check import decode_gap, probe_ids
from draftsmith.target.delta_rule import PER_TOKEN, per_token_modules, per_token_rule
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.recurrent import LAYER_KINDS, LinearAttentionLayer
from draftsmith.scripts import check_target

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

FAMILIES = sorted(HYBRIDS)
# transformers' multi-token cached path computes another function than its one-token step (docs/hybrid.md)
DIFFERS = {"jamba": 1.0, "zamba": 0.1, "zamba2": 1e-4}
assert set(DIFFERS) == set(one_token.ONE_TOKEN_FAMILIES)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_verify_computes_the_one_token_decode(arch):
    target = hybrid_target(arch)
    gap = decode_gap(target, probe_ids(target))
    assert gap.exact and gap.max_diff < 2e-5, (arch, gap)
    raw = decode_gap(target, probe_ids(target), routes=())  # transformers' code alone
    assert raw.exact == (arch not in DIFFERS) and raw.max_diff > DIFFERS.get(arch, 0), (arch, raw)


def _counted(fn, into: list):
    @functools.wraps(fn)
    def counted(query, *args, **kwargs):
        into.append(query.shape[1])
        return fn(query, *args, **kwargs)
    return counted


@pytest.mark.parametrize("arch", FAMILIES)
def test_three_hundred_tokens_stay_exact(arch, monkeypatch):
    """A rollback at every step (3 of 4 drafts right) over 300 tokens; the per-token Gated DeltaNet rule
    (target/delta_rule.py) engaged on multi-token verifies exactly where the family has Gated DeltaNet layers:
    counted (this was test_delta_rule.py's per-family test, which decoded every family again with
    n-grams and a head, as test_infer_hybrid.py's per-family tests do with the routing on)."""
    target = hybrid_target(arch)
    ids = hybrid_prompt(random.Random(arch), 8)
    ref = hf(target, ids, 300)
    routed = []
    for module in per_token_modules(target):
        if hasattr(module, PER_TOKEN):  # a Gated DeltaNet modeling module (not a Mamba-2 one, nor a mixer)
            monkeypatch.setattr(module, PER_TOKEN, _counted(getattr(module, PER_TOKEN), routed))
    assert torch.equal(SpeculativeGenerator(target, Oracle(ref)).generate(ids, max_new_tokens=300), ref), arch
    assert (LAYER_KINDS[arch] == "Gated DeltaNet") == any(n > 1 for n in routed), (arch, routed[:20])


def test_mixers_run_per_token_only_inside_the_context():
    target = hybrid_target("jamba")
    mixers = one_token.one_token_mixers(target)
    assert len(mixers) == 3 and one_token.one_token_mixers(hybrid_target("lfm2")) == ()
    with pytest.raises(RuntimeError, match="inside"):
        with per_token_rule(per_token_modules(target)), per_token_rule(per_token_modules(target)):
            assert all(getattr(m.forward, "runs_one_token", False) for m in mixers)
            raise RuntimeError("inside")
    assert not any(hasattr(m.forward, "runs_one_token") or "forward" in vars(m) for m in mixers)


def _no_routing(monkeypatch):
    """The fix disabled: every mixer verifies through transformers' multi-token path."""
    monkeypatch.setattr(one_token, "ONE_TOKEN_FAMILIES", ())


def test_jamba_without_the_fix_differs_from_generate(monkeypatch):
    target = hybrid_target("jamba")
    ids = hybrid_prompt(random.Random(1), 12)
    ref = hf(target, ids, 24)
    assert torch.equal(SpeculativeGenerator(target, NgramDrafter(length=4)).generate(ids, max_new_tokens=24), ref)
    _no_routing(monkeypatch)
    assert not torch.equal(SpeculativeGenerator(target, NgramDrafter(length=4)).generate(ids, max_new_tokens=24), ref)


@pytest.fixture(scope="module")
def saved_jamba(tmp_path_factory):
    path = tmp_path_factory.mktemp("jamba")
    hybrid_target("jamba").save_pretrained(path)
    return path


def test_check_target_passes_a_fixed_family_and_flags_it_unfixed(saved_jamba, monkeypatch, capsys):
    assert check_target.cli([str(saved_jamba)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("JambaForCausalLM (jamba): speculative decoding can be exact") and "\n" not in line
    _no_routing(monkeypatch)
    assert check_target.cli([str(saved_jamba)]) == 1
    line = capsys.readouterr().out.strip()
    assert "cannot be exact" in line and "the same greedy token at" in line and "\n" not in line, line


def test_check_target_bad_input_and_refused_families(tmp_path, capsys):
    assert check_target.cli([str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    from transformers import AutoConfig

    AutoConfig.for_model("mamba", vocab_size=32, hidden_size=16, num_hidden_layers=1).save_pretrained(tmp_path)
    assert check_target.cli([str(tmp_path)]) == 1  # refused from its config, before any weights
    assert "(mamba): its Mamba-1 layers are not supported" in capsys.readouterr().out


def test_the_generator_checks_an_untested_stateful_family(monkeypatch):
    """A stateful family outside LAYER_KINDS is refused with what check-target says of it."""
    monkeypatch.setattr(decode_check, "_UNTESTED", {})
    monkeypatch.delitem(recurrent.LAYER_KINDS, "jamba")
    _no_routing(monkeypatch)  # an untested family: nothing routed
    with pytest.raises(ValueError, match=r"JambaForCausalLM \(jamba\): speculative decoding cannot be exact"):
        SpeculativeGenerator(hybrid_target("jamba"), NgramDrafter())
    monkeypatch.delitem(recurrent.LAYER_KINDS, "lfm2")
    with pytest.raises(ValueError, match=r"not verified lossless.*max \|logit difference\| .* 8 of 8 positions"):
        SpeculativeGenerator(hybrid_target("lfm2"), NgramDrafter())
