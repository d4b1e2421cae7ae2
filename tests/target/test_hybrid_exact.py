"""Exact against the target's own decode: a verify computes what ``generate``'s one-token steps compute, on
every family (Jamba's and Zamba's Mamba-1 only with their mixers run per token, target/one_token.py;
Nemotron-H's and Zamba2's Mamba-2 only with their scans run without the dt clamp their chunked path alone
applies, target/delta_rule.py); every Mamba-2 family decodes 20 prompts x 30 tokens as ``generate`` does;
``draftsmith check-target`` says so in one line and flags a target whose verifies disagree along a greedy
run; the generator says it when it meets an untested stateful family; 300 tokens stay exact, with each
routing engaged exactly where its family needs it (counted)."""
from __future__ import annotations

import functools
import random

import pytest
import torch
from support.hybrids import HYBRIDS, make_tiny_hybrid
from support.infer_hybrid import hybrid_prompt, hybrid_target
from support.oracle import Oracle
from support.reference import hf_greedy

import draftsmith.target.decode_check as decode_check
import draftsmith.target.delta_rule as delta_rule
import draftsmith.target.one_token as one_token
import draftsmith.target.positions as positions
import draftsmith.target.recurrent as recurrent
from draftsmith.infer import SpeculativeGenerator
from draftsmith.target.decode_check import decode_gap, probe_ids
from draftsmith.target.delta_rule import PER_TOKEN, per_token_modules, per_token_rule
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.recurrent import LAYER_KINDS, LinearAttentionLayer
from draftsmith.scripts import check_target

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

FAMILIES = sorted(HYBRIDS)
# the families whose verify keeps every position's state (rollback="recorded", target.positions): not Kimi Delta
# Attention (its rule is not routed) nor Jamba's and Zamba's Mamba-1 (their mixers run per token)
RECORDED = set(FAMILIES) - {"kimi_linear", "bailing_hybrid", "jamba", "zamba"}
CLAMPED = {"nemotron_h", "zamba2"}  # Mamba-2 mixers clamping dt in their chunked scan only (time_step_min)
# transformers' multi-token cached path computes another function than its one-token step (docs/hybrid.md):
# the least max |logit difference| of one verify of 8 on tests/support/hybrids.py's model
DIFFERS = {"jamba": 1.0, "zamba": 0.1, "zamba2": 1e-3, "nemotron_h": 1e-4}
assert set(DIFFERS) == set(one_token.ONE_TOKEN_FAMILIES) | CLAMPED


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


def _counting_steps(monkeypatch, into: list):
    """Each stateful call of a mixer run per token (``one_token``), as (its tokens, the one-token forwards it ran)."""
    stepped = one_token._stepped

    def counting(mixer, forward):
        inner = []
        swapped = stepped(mixer, lambda *a, **k: inner.append(1) or forward(*a, **k))

        def outer(*args, **kwargs):
            inner.clear()
            out = swapped(*args, **kwargs)
            into.append(((args[0] if args else kwargs["hidden_states"]).shape[1], len(inner)))
            return out
        return outer
    monkeypatch.setattr(one_token, "_stepped", counting)


def _counting_scans(monkeypatch, into: list):
    """Each routed Mamba-2 scan (the chunked one, or a recorded verify's), as (its tokens, whether it had a state,
    the dt_limit it ran with)."""
    short_scan = delta_rule._short_scan

    def counting(chunked):
        def recorded(hidden_states, *args, initial_states=None, **kwargs):
            into.append((hidden_states.shape[1], initial_states is not None, kwargs.get("dt_limit")))
            return chunked(hidden_states, *args, initial_states=initial_states, **kwargs)
        return short_scan(recorded)
    monkeypatch.setattr(delta_rule, "_short_scan", counting)
    recording = positions.mamba2_scan  # a recorded verify's scan (it replaces the chunked one there)

    def counted(hidden_states, dt, A, B, C, initial_states, *args):
        into.append((hidden_states.shape[1], initial_states is not None, args[-1]))
        return recording(hidden_states, dt, A, B, C, initial_states, *args)
    monkeypatch.setattr(positions, "mamba2_scan", counted)


@pytest.mark.parametrize("arch", FAMILIES)
def test_three_hundred_tokens_stay_exact(arch, monkeypatch):
    """A rollback at every step (3 of 4 drafts right) over 300 tokens, by default (recorded states where the family
    keeps them, else merged), each routing counted where it engaged on multi-token verifies: the per-token Gated
    DeltaNet rule (or its recording twin) exactly on the Gated DeltaNet families, the
    mixers one token at a time exactly on Jamba and Zamba (each such call ran one forward per token), and
    every stateful Mamba-2 scan without the dt clamp (on Nemotron-H and Zamba2, whose mixers clamp)."""
    target = hybrid_target(arch)
    ids = hybrid_prompt(random.Random(arch), 8)
    ref = hf_greedy(target, ids, 300)
    routed, stepped, scans = [], [], []
    for module in per_token_modules(target):
        if hasattr(module, PER_TOKEN):  # a Gated DeltaNet modeling module (not a Mamba-2 one, nor a mixer)
            monkeypatch.setattr(module, PER_TOKEN, _counted(getattr(module, PER_TOKEN), routed))
    recording = positions.recurrent_gated_delta_rule  # where the verify keeps every position's state
    monkeypatch.setattr(positions, "recurrent_gated_delta_rule", _counted(recording, routed))
    _counting_steps(monkeypatch, stepped)
    _counting_scans(monkeypatch, scans)
    gen = SpeculativeGenerator(target, Oracle(ref))
    assert torch.equal(gen.generate(ids, max_new_tokens=300), ref), arch
    assert gen.rollback.rule == ("recorded" if arch in RECORDED else "merged"), arch
    assert (LAYER_KINDS[arch] == "Gated DeltaNet") == any(n > 1 for n in routed), (arch, routed[:20])
    per_token = [(n, calls) for n, calls in stepped if n > 1]
    assert bool(per_token) == (arch in one_token.ONE_TOKEN_FAMILIES), (arch, stepped[:20])
    assert all(calls == n for n, calls in per_token), (arch, per_token[:20])
    stateful = [limit for n, state, limit in scans if state and n > 1]
    assert bool(stateful) == (LAYER_KINDS[arch] == "Mamba-2"), (arch, scans[:20])
    assert all(limit == one_token.NO_LIMIT for limit in stateful), (arch, stateful[:20])
    assert bool(one_token.clamped_mixers(target)) == (arch in CLAMPED), arch  # where dropping the clamp matters


def _twenty_prompts() -> torch.Tensor:
    return torch.cat([hybrid_prompt(random.Random(p), 12) for p in range(20)])


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_decodes_like_generate_on_twenty_prompts(arch):
    """Every hybrid family: 20 prompts x 30 new tokens in one batch, each row equal to ``generate``'s: an oracle
    drafter (3 right then a wrong one: a rollback at every step, merged) and n-grams (rows accept apart: replays).
    fp32: no near-tie needed settling in float64 here. With the clamp kept, Nemotron-H differed on 3 of the 20 rows."""
    target = hybrid_target(arch)
    ids = _twenty_prompts()
    ref = hf_greedy(target, ids, 30)
    for drafter in (Oracle(ref), NgramDrafter(length=4)):
        out = SpeculativeGenerator(target, drafter).generate(ids, max_new_tokens=30)
        assert [row for row in range(20) if not torch.equal(out[row], ref[row])] == [], (arch, type(drafter).__name__)


def test_a_clamping_mixer_runs_per_token_where_its_scan_is_not_routed(monkeypatch):
    """Where the scan is not transformers' torch reference on the CPU (mamba_ssm's kernels, a GPU), Nemotron-H's
    mixers run one token at a time instead: the same 20 prompts x 30 tokens equal ``generate``'s."""
    monkeypatch.setattr(delta_rule, "_is_torch_reference", lambda fn: False)
    target = hybrid_target("nemotron_h")
    assert per_token_modules(target) == one_token.clamped_mixers(target) and len(one_token.clamped_mixers(target)) == 2
    ids = _twenty_prompts()
    ref = hf_greedy(target, ids, 30)
    out = SpeculativeGenerator(target, Oracle(ref)).generate(ids, max_new_tokens=30)
    assert [row for row in range(20) if not torch.equal(out[row], ref[row])] == []


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
    ref = hf_greedy(target, ids, 24)
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


def test_check_target_follows_greedy_runs_not_one_verify(tmp_path, monkeypatch, capsys):
    """Nemotron-H at its default time_step_min (0.001): its dt reaches the clamp rarely, so one verify of 8
    through transformers' path alone agrees with 8 one-token steps while the greedy runs check-target follows
    do not; with the routing check-target passes it."""
    model = make_tiny_hybrid("nemotron_h", time_step_min=0.001)
    assert decode_gap(model, probe_ids(model), routes=()).exact  # one verify would pass it unrouted
    model.save_pretrained(tmp_path)
    assert check_target.cli([str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("NemotronHForCausalLM (nemotron_h): speculative decoding can be exact") and "\n" not in line
    assert "greedy runs of 32 tokens" in line, line
    monkeypatch.setattr(decode_check, "per_token_modules", lambda model, **kw: ())  # transformers' path: the clamp kept
    assert check_target.cli([str(tmp_path)]) == 1
    assert "cannot be exact" in capsys.readouterr().out


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
    compared = r"not verified lossless.*greedy runs.*max \|logit difference\| .* 64 of 64 positions"
    with pytest.raises(ValueError, match=compared):
        SpeculativeGenerator(hybrid_target("lfm2"), NgramDrafter())
