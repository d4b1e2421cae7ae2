"""infer.traversal (Traversal Verification) and the token-level rule on sampled trees: the emitted tokens follow the
target's law at every prefix (chi-square over many vectorised trials, fixed seeds) on a chain, a wide root and a
two-level tree with siblings under siblings, for trees drawn from a draft law and for fixed drafts; the sequence-level
rule keeps more than the token-level one on sampled trees and the same on fixed ones; planted biases are caught."""
from __future__ import annotations

import pytest
import torch
from support.sampling import small_target  # noqa: F401  (fixture)
from support.traversal import SHAPES, draw_trees, emitted, mean_accepted, node_laws, prefix_pvalue, toy_laws

from draftsmith.infer import traversal
from draftsmith.infer.accept import tree_sample_accept
from draftsmith.infer.traversal import traversal_accept
from draftsmith.infer.tree import tree_from_parents

TRIALS = 40_000


def _target() -> list[torch.Tensor]:
    """The target's laws; after the first token the least likely one is filtered out (probability 0, as top-k)."""
    laws = toy_laws(0, 1.2)
    for k in range(1, len(laws)):
        laws[k] = laws[k].scatter(1, laws[k].argmin(dim=1, keepdim=True), 0.0)
        laws[k] = laws[k] / laws[k].sum(dim=1, keepdim=True)
    return laws


def _draft() -> list[torch.Tensor]:
    """A draft law close to the target's but not equal (half of it, half another random law)."""
    return [0.5 * t + 0.5 * o for t, o in zip(toy_laws(0, 1.2), toy_laws(1, 1.5))]


def _case(shape: str, sampled: bool, seed: int = 0):
    """(probs (B, N, V), tokens (B, N), tree, q (B, N-1, V) or None) for TRIALS trials."""
    parents = SHAPES[shape]
    tokens, ids = draw_trees(parents, _draft(), TRIALS, sampled, seed=seed)
    probs = node_laws(_target(), parents, ids)
    q = node_laws(_draft(), parents, ids)[:, [max(p, 0) for p in parents[1:]]] if sampled else None
    return probs, tokens, tree_from_parents(parents), q


def _run(rule, shape: str, sampled: bool):
    probs, tokens, tree, q = _case(shape, sampled)
    torch.manual_seed(2)
    if rule == "traversal":
        out = traversal_accept(probs, tokens, tree, q)
    else:
        full = None if q is None else torch.zeros_like(probs).index_copy(1, tree.parents[1:], q)
        out = tree_sample_accept(probs, tokens, tree.children, q=full)
    return out, tokens


@pytest.mark.parametrize("rule", ["traversal", "token"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "fixed"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_emitted_tokens_follow_the_target_law(rule, shape, sampled):
    out, tokens = _run(rule, shape, sampled)
    pvalue, tested = prefix_pvalue(_target(), emitted(out, tokens))
    assert tested >= 4, tested  # the first token and the tokens after several accepted prefixes
    assert pvalue > 1e-3, pvalue
    assert int(out.length.max()) == int(tree_from_parents(SHAPES[shape]).depths.max()) + 1  # deepest leaf reached


@pytest.mark.parametrize("shape", ["chain", "two-level"])
def test_sequence_level_keeps_more_on_sampled_trees(shape):
    """Sampled drafts: traversal accepts more than the token-level rule (seeded: 0.05+ tokens per step here);
    fixed drafts: both reach every node with its path's target probability, so their means agree."""
    sampled = mean_accepted(_run("traversal", shape, True)[0]) - mean_accepted(_run("token", shape, True)[0])
    fixed = mean_accepted(_run("traversal", shape, False)[0]) - mean_accepted(_run("token", shape, False)[0])
    assert sampled > 0.03, sampled
    assert abs(fixed) < 0.02, fixed


def _no_weight_update(w, p, q, parent, y, rows):
    """Plant: the residual laws are updated but the parent's weight is not (w_b stays as it was)."""
    saved = w[:, parent].clone()
    _reject(w, p, q, parent, y, rows)
    w[:, parent] = saved


_reject = traversal._reject


@pytest.mark.parametrize("plant", ["weight", "residual"])
def test_the_law_test_catches_a_planted_bias(monkeypatch, plant):
    """The same harness fails a broken rule: the weight not carried up after a rejection, or the parent's target
    law left unrenormalised (P_b kept instead of max(0, w_b P_b - Q_b) / its sum)."""
    if plant == "weight":
        monkeypatch.setattr(traversal, "_reject", _no_weight_update)
    else:
        def keep_law(w, p, q, parent, y, rows):
            saved = p[:, parent].clone()
            _reject(w, p, q, parent, y, rows)
            p[:, parent] = saved
        monkeypatch.setattr(traversal, "_reject", keep_law)
    out, tokens = _run("traversal", "two-level", True)
    assert prefix_pvalue(_target(), emitted(out, tokens))[0] < 1e-6


# ----------------------------------------------------------------------------- end to end, batches included


def _first_three(gen, ids, mask, calls: int, **sampling) -> torch.Tensor:
    """The first three new tokens of every row but the odd one (row ROWS // 2, a longer prompt), ``calls`` times;
    each call decodes 5 tokens so its first step drafts 3 levels deep (the law test reads 3)."""
    torch.manual_seed(0)
    out = []
    for _ in range(calls):
        new = gen.generate(ids, attention_mask=mask, max_new_tokens=5, **sampling)[:, ids.shape[1]: ids.shape[1] + 3]
        out += [*new[: ROWS // 2], *new[ROWS // 2 + 1:]]
    return torch.stack(out)


ROWS = 101


@pytest.mark.parametrize("rule", ["traversal", "exact"])
def test_sampled_trees_decode_the_target_law_in_padded_batches(small_target, rule):
    """Generation end to end: left-padded batches (the sampling test's prompt around a longer one) whose drafts are
    sampled two-level trees drawn near the target's law decode the target's exact law of three tokens under
    either lossless rule (chi-square, 1000 rows, fixed seed), and accept deep drafts doing so."""
    from support.batch import left_pad
    from support.sampling import PROMPT, exact_law, joint_pvalue
    from support.traversal import SampledOracleDrafter

    from draftsmith.infer import SpeculativeGenerator

    gen = SpeculativeGenerator(small_target, SampledOracleDrafter(small_target, PROMPT[0].tolist()), acceptance=rule)
    prompt = PROMPT[0].tolist()
    ids, mask = left_pad([prompt] * (ROWS // 2) + [[7, 2, 6, 4, 3]] + [prompt] * (ROWS // 2))
    samples = _first_three(gen, ids, mask, 10, temperature=0.9, top_k=6)
    assert joint_pvalue(samples, exact_law(small_target, 0.9, 6, 1.0)) > 1e-3
    assert gen.last_stats.tau > 2.0, gen.last_stats.tau  # deep drafts accepted: the residual paths ran
