"""An MTP block of two layers (a tiny DeepSeek-V3-style target whose checkpoint carries ``model.layers.{2,3}``):
draft level s uses layer s mod 2 (vLLM's ``spec_step_idx % num_mtp_layers``), checked against an independent
reference that recomputes every level without a cache (tests/support/mtp_layers.py); greedy output is the
target's own for chains and a two-row batch; trees are refused in one line."""
from __future__ import annotations

import pytest
import torch
from support.mtp_layers import make_layers_target, reference_layers_chain
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter

PROMPT = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return make_layers_target(tmp_path_factory.mktemp("mtp2") / "target")


@torch.no_grad()
def _first_logits(target, head, ids: torch.Tensor, k: int) -> list[torch.Tensor]:
    """The draft logits (V,) of the drafter's first greedy chain of ``k`` after ``ids``, level by level."""
    drafter = make_drafter(head, target, Chain(k))
    seen = []
    logits = drafter._logits
    drafter._logits = lambda hidden: seen.append(logits(hidden)) or seen[-1]
    states = drafter.new_rows([ids], [ids.shape[1] + 16])
    out = target(ids, output_hidden_states=True)
    root = out.logits[0, -1].argmax()
    drafter.observe_rows(states, [out.hidden_states[-1]], [torch.cat([ids[0, 1:], root[None]])[None]])
    drafts = drafter.propose_rows(states, [root], Sampling(), [k])[0].tokens[1:]
    assert drafts.tolist() == [int(x[0].argmax()) for x in seen]
    return [x[0] for x in seen]


def test_the_head_has_both_layers(two):
    head = build_head("mtp", two.model)
    assert head.config.num_mtp_layers == 2 and len(head.layers) == 2


@pytest.mark.parametrize("k", [1, 2, 5])
def test_drafts_are_the_reference_chain(two, k):
    """Every level's draft logits: k = 5 > 2 layers, layer 0 drafts levels 0, 2, 4, layer 1 levels 1, 3."""
    head = build_head("mtp", two.model)
    got, want = _first_logits(two.model, head, PROMPT, k), reference_layers_chain(two, PROMPT, k)
    assert len(got) == len(want) == k
    for level, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"level {level}")


def test_the_reference_tells_the_layer_choice_apart(two):
    """The comparison above can fail: drafting every level with layer 0 gives other logits from level 1 on."""
    ours, zero = reference_layers_chain(two, PROMPT, 5), reference_layers_chain(two, PROMPT, 5, pick=lambda s, n: 0)
    assert torch.equal(ours[0], zero[0]) and (ours[1] - zero[1]).abs().max() > 1e-2


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_output_is_the_targets_own(two, k):
    head = build_head("mtp", two.model)
    gen = SpeculativeGenerator(two.model, head, tree=Chain(k))
    assert torch.equal(gen.generate(PROMPT, max_new_tokens=20), hf_greedy(two.model, PROMPT, 20))


def test_greedy_batch_rows_are_each_rows_own(two):
    rows = [[1, 5, 3, 6, 7, 4, 7], [1, 2, 6, 3]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = SpeculativeGenerator(two.model, build_head("mtp", two.model), tree=Chain(3)).generate(
        ids, attention_mask=mask, max_new_tokens=12)
    for b, row in enumerate(rows):
        assert torch.equal(out[b, width:], hf_greedy(two.model, torch.tensor([row]), 12)[0, len(row):]), b


def test_a_tree_is_refused_in_one_line(two):
    with pytest.raises(ValueError, match=r"^an MTP head of 2 layers drafts chains \(level s uses layer s mod 2\), "
                                         r"not a DynamicTree: pass a chain$"):
        make_drafter(build_head("mtp", two.model), two.model, DynamicTree(depth=3, top_k=2, total_tokens=6))

