"""Batch speculation: a left-padded batch decoded together, each row token-identical (greedy, fp32)
to ``target.generate`` of that row alone, whatever the drafter, the prompt lengths and where each
row stops (its own EOS or the budget).

Random heads accept little, so a per-row oracle drafter (the row's own greedy continuation with
decoys and planted mistakes, found from the prompt each row's drafter state sees) drives long and
different accepted runs per row; it also checks that each row's drafter gets the true target
features of exactly its accepted tokens (positions and cache slots per row).
"""
from __future__ import annotations

import random

import pytest
import torch
from support.targets import make_tiny_target
from support.batch import (
    BATCH_ARCHES,
    DRAFTERS,
    PAD,
    VOCAB,
    batch_alone,
    batch_prompts,
    expected,
    left_pad,
    oracle,
    target,
)

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.cache import StaticHeadCache
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.infer.tree import tree_attention_mask


@pytest.fixture(scope="module", params=BATCH_ARCHES)
def target32(request):
    return target(request.param)


@pytest.mark.parametrize("bsz", [1, 2, 4])
def test_oracle_batch_matches_each_row_alone(target32, bsz):
    rng = random.Random(f"{target32.config.model_type}-{bsz}")
    for case in range(2):
        prompts = batch_prompts(rng, [rng.randrange(1, 12) for _ in range(bsz)])
        max_new = rng.randrange(12, 40)
        # EOS: a token the first row emits mid-way (other rows may or may not meet it)
        eos = int(batch_alone(target32, prompts[0], max_new)[max_new // 2]) if case else None
        gen = SpeculativeGenerator(target32, oracle(target32, prompts, max_new, depth=6, seed=case))
        ids, mask = left_pad(prompts)
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
        assert torch.equal(out, expected(target32, prompts, max_new, eos)), (case, eos)
        stats = gen.last_stats
        assert stats.tau > 1.5, stats  # long accepted runs went through
        assert stats.target_forwards == stats.steps + 1


def test_oracle_batch_of_8_rows_stop_at_different_steps():
    model = target("llama")
    rng = random.Random(8)
    prompts = batch_prompts(rng, [1, 9, 4, 12, 2, 7, 5, 3])
    max_new = 30
    eos = int(batch_alone(model, prompts[3], max_new)[10])
    gen = SpeculativeGenerator(model, oracle(model, prompts, max_new, depth=5, seed=8))
    ids, mask = left_pad(prompts)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
    assert torch.equal(out, expected(model, prompts, max_new, eos))
    ends = {int((row != PAD).sum()) for row in out[:, ids.shape[1]:]}
    assert len(ends) > 1  # the rows did stop at different lengths


_ROWS: dict[tuple[str, int, bool], tuple[list[list[int]], int | None, torch.Tensor]] = {}


def _rows(model, bsz: int, repetitive: bool) -> tuple[list[list[int]], int | None, torch.Tensor]:
    """A family's prompts for a batch size, its EOS and HF's rows alone, made once for every drafter (the
    rows' references were most of these tests' time; ``target`` builds the same model for a family)."""
    key = (model.config.model_type, bsz, repetitive)
    if key not in _ROWS:
        rng = random.Random(f"{key}")
        prompts = batch_prompts(rng, [rng.randrange(2, 14) for _ in range(bsz)], repetitive=repetitive)
        eos = int(batch_alone(model, prompts[-1], 24)[7]) if bsz > 1 else None
        _ROWS[key] = prompts, eos, expected(model, prompts, 24, eos)
    return _ROWS[key]


_FAMILY_TARGETS: dict[str, torch.nn.Module] = {}


def _family_target(arch: str):
    if arch not in _FAMILY_TARGETS:
        _FAMILY_TARGETS[arch] = target(arch)
    return _FAMILY_TARGETS[arch]


# Every drafter on llama at batch sizes 1 (a row alone), 4 and 8 (rows stopping at different steps: eos), and on
# each other family at 8 (its own attention and cache under left padding and rows stopping apart); the other
# families at 1 and 4 repeated llama's batch paths (were every drafter x family x size: 108 cases; docs/testing.md,
# round 5).
CASES = [("llama", bsz) for bsz in (1, 4, 8)] + [(arch, 8) for arch in BATCH_ARCHES if arch != "llama"]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize(("arch", "bsz"), CASES)
def test_every_drafter_batch_matches_each_row_alone(arch, bsz, name):
    model = _family_target(arch)
    torch.manual_seed(random.Random(f"{arch}-{name}-{bsz}").randrange(1000))
    drafter, tree = DRAFTERS[name](model)
    gen = SpeculativeGenerator(model, drafter, tree=tree)
    prompts, eos, ref = _rows(model, bsz, repetitive=name.startswith("ngram"))
    ids, mask = left_pad(prompts)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos), ref)


def test_batch_without_attention_mask_or_padding():
    model = target("qwen2")
    prompts = batch_prompts(random.Random(3), [6, 6, 6])
    gen = SpeculativeGenerator(model, NgramDrafter())
    out = gen.generate(torch.tensor(prompts), max_new_tokens=15)
    assert torch.equal(out, expected(model, prompts, 15))
    # the same generator goes back to batch size 1 (the static buffer follows the batch size)
    one = gen.generate(torch.tensor(prompts[:1]), max_new_tokens=15)
    assert torch.equal(one, expected(model, prompts[:1], 15))


def test_batch_pads_with_the_pad_id_after_each_rows_end():
    model = target("llama")
    prompts = batch_prompts(random.Random(4), [3, 8])
    eos = int(batch_alone(model, prompts[0], 20)[4])
    ids, mask = left_pad(prompts)
    out = SpeculativeGenerator(model, NgramDrafter()).generate(ids, attention_mask=mask, max_new_tokens=20,
                                                               eos_token_id=eos, pad_token_id=77)
    ref = expected(model, prompts, 20, eos)
    new = ref[:, ids.shape[1]:]
    row0 = batch_alone(model, prompts[0], 20, eos)
    assert row0.numel() == 5 and torch.equal(out[0, ids.shape[1]: ids.shape[1] + 5], row0)
    assert (out[0, ids.shape[1] + 5:] == 77).all() and out.shape == ref.shape
    assert torch.equal(out[1, ids.shape[1]:], new[1])


def test_batch_bad_inputs_raise_clear_errors():
    model = target("llama")
    gen = SpeculativeGenerator(model, NgramDrafter())
    ids, mask = left_pad([[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="left-padded"):
        gen.generate(ids, attention_mask=mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mask must be a tensor"):
        gen.generate(ids, attention_mask=mask[:, 1:], max_new_tokens=4)
    with pytest.raises(ValueError, match="0 \\(pad\\) and 1"):
        gen.generate(ids, attention_mask=mask * 2, max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 0"):
        gen.generate(ids[:0], max_new_tokens=4)
    one = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="streamer needs batch size 1"):
        gen.generate(one.repeat(2, 1), max_new_tokens=4, streamer=object())


# ----------------------------------------------------------------------------- sampling per row


@pytest.mark.slow
@pytest.mark.parametrize("name", ["stub-full-tree", "eagle-chain", "eagle3-tree", "medusa-tree", "dflash-chain",
                                  "eagle-chosen", "eagle3-chosen-tree"])
def test_padded_rows_sample_the_target_law(name):
    """Sampling per row: rows holding the sampling test's prompt behind left padding, batched with a
    longer prompt, draw their first three tokens from the target's exact law (chi-square; 2000 rows in
    20 calls of 100 padded rows around the longer one)."""
    from support.sampling import CONFIGS, PROMPT, config_generator, exact_law, joint_pvalue, make_small_target

    model = make_small_target()
    kind, tree, sampling = {**CONFIGS, "dflash-chain": ("dflash", Chain(3), {"temperature": 0.9, "top_k": 6})}[name]
    torch.manual_seed(1)
    gen = config_generator(model, kind, tree)
    prompt = PROMPT[0].tolist()
    ids, mask = left_pad([prompt] * 50 + [[7, 2, 6, 4, 3]] + [prompt] * 50)
    torch.manual_seed(0)
    samples = []
    for _ in range(20):
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=3, **sampling)[:, ids.shape[1]:]
        samples += [*out[:50], *out[51:]]
    law = exact_law(model, sampling.get("temperature", 1.0), sampling.get("top_k", 0), sampling.get("top_p", 1.0))
    assert joint_pvalue(torch.stack(samples), law) > 1e-3


def test_compiled_batch_pads_every_row_to_the_budget():
    """compile: one [B, budget] shape over the whole buffer (traced with dynamo's eager backend)."""
    model = target("llama")
    rng = random.Random(9)
    prompts = batch_prompts(rng, [4, 10, 7])
    max_new = 20
    eos = int(batch_alone(model, prompts[1], max_new)[6])
    gen = SpeculativeGenerator(model, oracle(model, prompts, max_new, depth=4, seed=9), compile="eager")
    ids, mask = left_pad(prompts)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
    assert torch.equal(out, expected(model, prompts, max_new, eos))
    assert gen.last_stats.verified_tokens == gen.last_stats.steps * 3 * gen.drafter.max_nodes


# ----------------------------------------------------------------------------- heads draft all rows at once


def test_head_cache_rows_equal_rows_alone():
    """A batched write of ragged rows (each keeping its own count) leaves every row as appending to it
    alone would, and the causal mask shows each row exactly its entries."""
    torch.manual_seed(0)
    counts = [3, 1, 0, 2]
    batch, alone = StaticHeadCache(capacity=2, rows=4), [StaticHeadCache(capacity=2) for _ in counts]
    first = torch.randn(4, 2, 3, 5)
    batch.counts = counts
    batch.update(0, first, first + 1)
    batch.counts = None
    for b, n in enumerate(counts):
        alone[b].update(0, first[b: b + 1, :, :n], first[b: b + 1, :, :n] + 1)
    mask = batch.causal_mask(2, torch.float32, first.device)  # (4, 1, 2, 3 + 2)
    assert mask.shape == (4, 1, 2, 5)
    for b, n in enumerate(counts):  # query i of row b sees its n entries and its own first i + 1 new ones
        assert (mask[b, 0] == 0).tolist() == [[c <= n + i for c in range(5)] for i in range(2)]
    second = torch.randn(4, 2, 2, 5)
    keys, _ = batch.update(0, second, second)  # past the capacity: every row's buffer doubles
    assert keys.shape[2] == 5 and batch.row_lengths() == [n + 2 for n in counts]
    for b, n in enumerate(counts):
        alone[b].update(0, second[b: b + 1], second[b: b + 1])
        assert torch.equal(batch.row(b).keys[0], alone[b].keys[0])
        assert torch.equal(batch.row(b).values[0], alone[b].values[0])
    batch.crop_rows([1, 9, 0, 2])
    assert batch.row_lengths() == [1, 3, 0, 2]


@pytest.mark.parametrize("prefixes", [[3, 3], [5, 2, 0]])
def test_head_cache_block_mask_is_each_rows_tree_mask(prefixes):
    """Each row's block mask is that row's one-row tree mask over its own prefix, its slots past it
    blocked (rows at one prefix and at different ones)."""
    torch.manual_seed(0)
    explored, q = 2, 3
    cache = StaticHeadCache(capacity=4, rows=len(prefixes))
    cache.counts = [n + explored for n in prefixes]
    cache.update(0, torch.zeros(len(prefixes), 1, max(cache.counts), 2), torch.zeros(len(prefixes), 1, max(cache.counts), 2))
    cache.counts = None
    block = torch.rand(len(prefixes), q, explored + q) < 0.5
    mask = cache.block_mask(prefixes, block, torch.float32)
    width = max(prefixes) + explored + q
    assert mask.shape == (len(prefixes), 1, q, width)
    blocked = torch.finfo(torch.float32).min
    for b, n in enumerate(prefixes):
        own = n + explored + q
        torch.testing.assert_close(mask[b: b + 1, :, :, :own], tree_attention_mask(block[b], n, torch.float32))
        assert (mask[b, 0, :, own:] == blocked).all()


@pytest.mark.parametrize("kind,tree", [("eagle", Chain(3)), ("eagle3", Chain(4)), ("dflash", Chain(3)),
                                       ("medusa", Chain(3)), ("eagle3", DynamicTree(depth=2, top_k=2, total_tokens=4))])
@pytest.mark.parametrize("greedy", [True, False])
def test_heads_draft_every_row_in_one_pass(kind, tree, greedy):
    """Rows observed and drafted together get the drafts each row gets alone (fp64: the same argmax;
    sampling: the same first draft law), with one head forward per draft level for the whole batch."""
    model = make_tiny_target("llama", dtype=torch.float64)
    torch.manual_seed(0)
    head = build_head(kind, model, **({"block_size": 5} if kind == "dflash" else {})).double().eval()
    drafter = make_drafter(head, model, tree)
    width = (len(drafter.aux_layer_ids) or 1) * model.config.hidden_size
    accepted = [5, 1, 3]  # accepted tokens per row (the prompt, then a step)
    feats = [torch.randn(1, n, width, dtype=torch.float64) for n in accepted]
    nexts = [torch.randint(3, VOCAB, (1, n)) for n in accepted]
    roots = [torch.tensor(11), torch.tensor(12), torch.tensor(13)]
    depths = [3, 1, 2]
    sampling = Sampling() if greedy else Sampling(temperature=0.8)
    calls, context = [], []
    head.register_forward_hook(lambda *_: calls.append(1))
    if kind == "dflash":  # DFlash observes through its context projection, not its forward
        head.fc.register_forward_hook(lambda *_: context.append(1))
    with torch.inference_mode():
        rows = drafter.new_rows([n[:, :1] for n in nexts], [16, 16, 16])
        drafter.observe_rows(rows, feats, nexts)
        assert len(context if kind == "dflash" else calls) == 1  # one pass for every row
        calls.clear()
        together = drafter.propose_rows(rows, roots, sampling, depths)
        if isinstance(tree, Chain):  # EAGLE: one head forward per draft level after the first; DFlash: one block
            assert len(calls) == {"eagle": max(depths) - 1, "eagle3": max(depths) - 1, "dflash": 1, "medusa": 0}[kind]
        for b in range(3):
            alone = drafter.new_rows([nexts[b][:, :1]], [16])  # the row as a batch of one
            drafter.observe_rows(alone, [feats[b]], [nexts[b]])
            draft, = drafter.propose_rows(alone, [roots[b]], sampling, [depths[b]])
            assert draft.tokens.shape == together[b].tokens.shape and int(together[b].tokens[0]) == int(roots[b])
            if greedy:
                assert torch.equal(draft.tokens, together[b].tokens), (kind, b)
            elif draft.q is not None:  # the first draft's law depends on the row's state alone (later ones on samples)
                torch.testing.assert_close(draft.q[0], together[b].q[0])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_dynamic_trees_draft_every_row_in_one_pass(kind):
    """EAGLE-2 trees drafted together (rows of different prefix lengths and depth limits, one row of
    the batch not drafting) equal each row's tree drafted alone, tokens and parents (fp64), with one
    head forward per level after the first for the whole batch."""
    model = make_tiny_target("llama", dtype=torch.float64, initializer_range=0.3)
    torch.manual_seed(1)
    head = build_head(kind, model).double().eval()
    with torch.no_grad():  # peaked draft laws: deep nodes outscore shallow ones, so depth limits and masks matter
        for p in head.parameters():
            p.mul_(10 if p.dim() > 1 else 1)
        if kind == "eagle3":
            head.lm_head.weight.mul_(5)
    tree = DynamicTree(depth=4, top_k=3, total_tokens=9)
    drafter = make_drafter(head, model, tree)
    width = (len(drafter.aux_layer_ids) or 1) * model.config.hidden_size
    accepted = [6, 2, 9, 4, 1]  # each row's accepted tokens: its own prefix length
    feats = [torch.randn(1, n, width, dtype=torch.float64) for n in accepted]
    nexts = [torch.randint(3, VOCAB, (1, n)) for n in accepted]
    roots = [torch.tensor(10 + b) for b in range(5)]
    drafting = [0, 1, 3, 4]  # row 2 has stopped: carried along, not drafted
    depths = [4, 2, 3, 0]  # the batch drafts 4 levels; the others keep fewer (0: the root alone)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    with torch.inference_mode():
        rows = drafter.new_rows([n[:, :1] for n in nexts], [16] * 5)
        drafter.observe_rows(rows, feats, nexts)
        calls.clear()
        together = drafter.propose_rows([rows[b] for b in drafting], [roots[b] for b in drafting], Sampling(), depths)
        assert len(calls) == tree.depth - 1  # one head forward per level for every row
        assert rows[0].cache.row_lengths() == accepted  # the exploration is dropped again
        limited = 0
        for b, depth, draft in zip(drafting, depths, together):
            alone = drafter.new_rows([nexts[b][:, :1]], [16])  # the row as a batch of one
            drafter.observe_rows(alone, [feats[b]], [nexts[b]])
            ref, = drafter.propose_rows(alone, [roots[b]], Sampling(), [depth])
            assert torch.equal(draft.tokens, ref.tokens), (kind, b)
            assert torch.equal(draft.tree.parents, ref.tree.parents), (kind, b)
            assert int(draft.tree.depths.max()) <= depth
            deepest, = drafter.propose_rows(alone, [roots[b]], Sampling(), [tree.depth])
            limited += not torch.equal(deepest.tree.parents, ref.tree.parents)
        assert limited >= 2  # the depth limits did cut rows' trees
