"""Decoding with the target's own MTP block (head.kind=mtp, head.init=native) on tiny DeepSeek-V3-style and
Qwen3-Next-style targets (the latter hybrid: Gated DeltaNet beside attention in its trunk; its MTP block is
full attention): the drafter proposes the chain the engines' formulas give (an independent reference,
tests/support/mtp_targets.py), reusing its one layer at every level; greedy output equals the target's own
``generate`` for chains, a dynamic tree and a batch; sampled output follows the target's law (chi-square)."""
from __future__ import annotations

import pytest
import torch
from support.mtp_targets import STYLES, make_mtp_target, reference_chain
from support.reference import hf_greedy
from support.sampling import PROMPT, exact_law, joint_pvalue, sample_triples

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.train.config import load_config
from draftsmith.train.objectives import objective_class


@pytest.fixture(scope="module", params=STYLES)
def mtp_target(request, tmp_path_factory):
    # 8 tokens: a random MTP block's greedy drafts are accepted often enough to exercise partial acceptance
    return make_mtp_target(request.param, tmp_path_factory.mktemp(request.param) / "target", vocab=8, sharpen=4.0)


def _hybrid(model) -> bool:
    return "linear_attention" in (getattr(model.config, "layer_types", None) or [])


@torch.no_grad()
def _first_drafts(target, head, ids: torch.Tensor, k: int) -> list[int]:
    """The drafter's first chain of ``k`` after the prompt ``ids``, fed as the generator feeds it (the target's
    final post-norm states and the token after each position, the last one the root)."""
    drafter = make_drafter(head, target, Chain(k))
    states = drafter.new_rows([ids], [ids.shape[1] + 16])
    out = target(ids, output_hidden_states=True)
    root = out.logits[0, -1].argmax()
    drafter.observe_rows(states, [out.hidden_states[-1]], [torch.cat([ids[0, 1:], root[None]])[None]])
    draft = drafter.propose_rows(states, [root], Sampling(), [k])[0]
    return draft.tokens[1:].tolist()


@pytest.mark.parametrize("k", [1, 4])
def test_drafts_are_the_reference_chain(mtp_target, k):
    """k = 4 > the block's one layer: the layer is reused at every level, on its own output."""
    head = build_head("mtp", mtp_target.model)
    ids = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])
    assert _first_drafts(mtp_target.model, head, ids, k) == reference_chain(mtp_target, ids, k)


def test_the_reference_chain_tells_heads_apart(mtp_target):
    """The comparison above can fail: a fresh (random) MTP block drafts another chain."""
    torch.manual_seed(0)
    head = build_head("mtp", mtp_target.model, init="fresh")
    ids = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])
    assert _first_drafts(mtp_target.model, head, ids, 4) != reference_chain(mtp_target, ids, 4)


@pytest.mark.parametrize("tree", [Chain(1), Chain(4), DynamicTree(depth=3, top_k=2, total_tokens=6)],
                         ids=["chain1", "chain4", "tree"])
def test_greedy_output_is_the_targets_own(mtp_target, tree):
    model = mtp_target.model
    head = build_head("mtp", model)
    prompt = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])
    if isinstance(tree, DynamicTree) and _hybrid(model):  # a hybrid's verify reads chains only (docs/hybrid.md)
        with pytest.raises(ValueError, match="is a hybrid .* drafts must be chains"):
            SpeculativeGenerator(model, head, tree=tree)
        return
    want = hf_greedy(model, prompt, 20)
    gen = SpeculativeGenerator(model, head, tree=tree)
    assert torch.equal(gen.generate(prompt, max_new_tokens=20), want)


def test_greedy_batch_rows_are_each_rows_own(mtp_target):
    """Two left-padded rows of different lengths, each the target's own greedy text."""
    model = mtp_target.model
    head = build_head("mtp", model)
    rows = [[1, 5, 3, 6, 7, 4, 7], [1, 2, 6, 3]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = SpeculativeGenerator(model, head, tree=Chain(3)).generate(ids, attention_mask=mask, max_new_tokens=12)
    for b, row in enumerate(rows):
        want = hf_greedy(model, torch.tensor([row]), 12)[0, len(row):]
        assert torch.equal(out[b, width:], want), b


def _tuned(t, prompts: torch.Tensor, steps: int = 30):
    """The native head fine-tuned ``steps`` steps (train.objectives.mtp, defaults) on the target's greedy text
    after ``prompts``, and the first and last steps' mean loss."""
    model = t.model
    head = build_head("mtp", model)
    cls = objective_class("mtp")
    objective = cls(head, load_config(None, ["head.kind=mtp"]))
    text = hf_greedy(model, prompts, 24)
    features = cls.features(model, {"input_ids": text, "loss_mask": torch.ones_like(text)}, head)
    optimizer = torch.optim.AdamW(objective.param_groups(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = objective(features, model.get_output_embeddings()).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return head.eval(), losses[0], losses[-1]


def test_a_tuned_block_is_accepted_and_stays_lossless(mtp_target):
    """Fine-tuned on the target's own text, the block's drafts are accepted (fewer target forwards than tokens)
    for a chain and a tree, a batch of two rows, and the output is still the target's own."""
    model = mtp_target.model
    prompts = torch.tensor([[1, 5, 3, 6], [1, 2, 6, 3], [1, 7, 4, 4], [1, 3, 3, 5]])
    head, first, last = _tuned(mtp_target, prompts)
    assert last < 0.7 * first, (first, last)
    want = hf_greedy(model, prompts[:2], 20)
    for tree in (Chain(4),) if _hybrid(model) else (Chain(4), DynamicTree(depth=4, top_k=2, total_tokens=8)):
        gen = SpeculativeGenerator(model, head, tree=tree)
        assert torch.equal(gen.generate(prompts[:2], max_new_tokens=20), want), tree
        assert gen.last_stats.target_forwards < 15, (tree, gen.last_stats)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_sampled_tokens_follow_the_target_law(style, tmp_path):
    """Chi-square on the joint law of the first three sampled tokens, an 8-token target (chains of 2)."""
    t = make_mtp_target(style, tmp_path / "target", vocab=8, seed=3)
    gen = SpeculativeGenerator(t.model, build_head("mtp", t.model), tree=Chain(2))
    law = exact_law(t.model, 0.9, 0, 1.0)
    samples, forwards = sample_triples(gen, 2000, temperature=0.9)
    assert joint_pvalue(samples, law) > 1e-3
    assert forwards < 3.0, forwards  # some drafts were accepted
    assert PROMPT.shape == (1, 3)


def test_greedy_output_is_transformers_own_mtp_decoding(tmp_path):
    """Mellum: transformers drafts with the same MTP layer itself (``generate(use_mtp=True)``, chains of one);
    ours, chains and a tree, gives the same greedy text."""
    t = make_mtp_target("mellum", tmp_path / "target", vocab=8, sharpen=4.0)
    prompt = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])
    want = t.model.generate(prompt, max_new_tokens=20, do_sample=False, use_mtp=True)
    assert torch.equal(want, hf_greedy(t.model, prompt, 20))
    head = build_head("mtp", t.model)
    for tree in (Chain(3), DynamicTree(depth=3, top_k=2, total_tokens=6)):
        assert torch.equal(SpeculativeGenerator(t.model, head, tree=tree).generate(prompt, max_new_tokens=20), want)
