"""DFlash drafting: token-identical to HF greedy (random heads on every family, a briefly trained head
with long accepted runs and EOS inside a block), its incremental context cache, save/load, and
sampling that follows the target's law (chi-square, as tests/infer/test_infer_sampling.py)."""
from __future__ import annotations

import random

import pytest
import torch
from support.targets import ARCHES, make_successor_target, make_tiny_target
from support.sampling import exact_law, joint_pvalue, sample_triples, small_target  # noqa: F401  (fixture)
from support.dflash_infer import fit_dflash

from draftsmith.heads import AutoHead, build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, default_tree, make_drafter
from draftsmith.train.config import load_config
from draftsmith.train.objectives import objective_class

VOCAB = 96


def _hf_greedy(model, ids, max_new, eos=None):
    return model.generate(ids, do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)


# aot_eager traces the DFlash drafter's path, which is the kind's, not the family's (the eager cases run
# every family): the traced cases of test_dflash_infer, test_dflash2 and test_dspark cover each family and
# each kind once (llama, mistral: DFlash; qwen2: DFlash2; qwen3: DSpark), not the full 4 x 3 grid
@pytest.mark.parametrize("arch, compile", [(a, False) for a in ARCHES] + [(a, "aot_eager") for a in ["llama", "mistral"]])
def test_random_head_greedy_matches_hf(arch, compile):
    target = make_tiny_target(arch, initializer_range=0.3)
    target.generation_config.eos_token_id = None
    rng = random.Random(f"dflash-{arch}-{compile}")
    torch.manual_seed(rng.randrange(1000))
    head = build_head("dflash", target, block_size=6, num_layers=2).eval()
    cases = [(Chain(1), 1, 1), (Chain(5), 6, 1), (Chain(5), 5, 20), (default_tree("dflash", "cpu"), 7, 15)]
    if compile:
        cases = [(Chain(3), 5, 12)]
    for tree, prompt_len, max_new in cases:
        gen = SpeculativeGenerator(target, head, tree=tree, compile=compile)
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(prompt_len)]])
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), _hf_greedy(target, ids, max_new)), tree
        assert gen.last_stats.new_tokens == max_new
    ref = _hf_greedy(target, ids, 20)
    eos = int(ref[0, ids.shape[1] + 7])
    gen = SpeculativeGenerator(target, head, tree=Chain(3), compile=compile)
    assert torch.equal(gen.generate(ids, max_new_tokens=20, eos_token_id=eos), _hf_greedy(target, ids, 20, eos=eos))


def test_context_cache_grows_incrementally():
    """Observing accepted tokens in pieces drafts exactly what observing them at once does."""
    target = make_tiny_target("qwen3")
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=5, num_layers=2).eval()
    drafter = make_drafter(head, target, Chain(4))
    feats = torch.randn(1, 7, len(head.feature_layer_ids) * 32)
    nxt = torch.randint(3, VOCAB, (1, 7))
    root = torch.tensor(11)
    # batches of one: a roomy cache read at once, and one just large enough read in pieces
    whole, pieces = drafter.new_rows([nxt[:, :1]], [32]) + drafter.new_rows([nxt[:, :1]], [7])
    drafter.observe_rows([whole], [feats], [nxt])
    with torch.no_grad():
        for a, b in ((0, 3), (3, 4), (4, 7)):
            drafter.observe_rows([pieces], [feats[:, a:b]], [nxt[:, a:b]])
        one, two = (drafter.propose_rows([s], [root], Sampling(), [4])[0] for s in (whole, pieces))
    assert pieces.cache.get_seq_length() == 7
    assert torch.equal(one.tokens, two.tokens) and one.tokens[0] == root and one.tokens.numel() == 5
    # the block is not cached: proposing twice drafts the same
    assert torch.equal(drafter.propose_rows([pieces], [root], Sampling(), [2])[0].tokens, two.tokens[:3])


def test_drafter_refuses_shapes_it_cannot_draft():
    target = make_tiny_target("llama")
    head = build_head("dflash", target, block_size=4)
    with pytest.raises(ValueError, match="block_size - 1 = 3"):
        make_drafter(head, target, Chain(4))
    with pytest.raises(TypeError, match="DynamicTree"):
        make_drafter(head, target, DynamicTree())


def test_the_defaults_fit_a_short_block():
    """A head of block_size 4 drafts 3 per block: the CPU default chain of 4 is cut to 3 for it (it was
    'Chain(length=4) exceeds ... block_size - 1 = 3'); the CLI's: tests/infer/test_infer_cli.py."""
    target = make_tiny_target("llama", initializer_range=0.3)
    target.generation_config.eos_token_id = None
    head = build_head("dflash", target, block_size=4).eval()
    gen = SpeculativeGenerator(target, head)
    assert gen.drafter.option == Chain(3)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(gen.generate(ids, max_new_tokens=9), _hf_greedy(target, ids, 9))


def test_save_reload_drafts_the_same(tmp_path):
    target = make_tiny_target("mistral")
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=4, mask_token_id=5).eval()
    head.save_pretrained(tmp_path)
    loaded = AutoHead.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(head) and loaded.config.mask_token_id == 5
    assert loaded.feature_layer_ids == head.feature_layer_ids
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("embed_tokens" in k or "lm_head" in k for k in a)  # the target's stay the target's
    ids = torch.tensor([[4, 9, 13]])
    outs = [SpeculativeGenerator(target, h, tree=Chain(3)).generate(ids, max_new_tokens=10) for h in (head, loaded)]
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def successor_target():
    """test_infer_trained's target (conftest.make_successor_target) and its greedy continuations."""
    model = make_successor_target(VOCAB)
    with torch.no_grad():
        torch.manual_seed(0)
        prompts = torch.randint(3, VOCAB, (128, 4))
        seqs = model.generate(prompts, do_sample=False, max_new_tokens=28, pad_token_id=0,
                              attention_mask=torch.ones_like(prompts))
    return model, seqs


def test_trained_head_is_lossless_with_long_runs(successor_target):
    model, seqs = successor_target
    torch.manual_seed(0)
    head = fit_dflash(model, seqs, build_head("dflash", model, block_size=5, num_layers=2), 600)
    gen = SpeculativeGenerator(model, head, tree=Chain(4))
    taus = []
    for i, ids in enumerate(torch.randint(3, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))):
        ids, max_new = ids[None], 20 + 5 * i
        ref = _hf_greedy(model, ids, max_new)
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), ref)
        taus.append(gen.last_stats.tau)
        eos = int(ref[0, 5 + max_new // 2])  # EOS inside what are now long accepted runs
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new, eos_token_id=eos),
                           _hf_greedy(model, ids, max_new, eos=eos))
        assert torch.equal(gen.generate(ids, max_new_tokens=1), ref[:, :6])
    assert sum(taus) / len(taus) > 1.5, taus


@pytest.mark.slow  # as tests/infer/test_infer_sampling.py's
@pytest.mark.parametrize("compile", [False, "eager"])
def test_first_tokens_follow_the_target_law(small_target, compile):  # noqa: F811
    sampling = {"temperature": 0.9, "top_k": 6}
    torch.manual_seed(1)
    head = build_head("dflash", small_target, block_size=3)
    # a little training on the target's laws, so that drafts are accepted (and rejected) often
    objective = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash"]))
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for step in range(60):
        ids = torch.randint(0, 8, (16, 10), generator=torch.Generator().manual_seed(step))
        features = objective.features(small_target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
        objective.perturb(features, None, seed=step)
        loss = objective(features, small_target.get_output_embeddings()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    gen = SpeculativeGenerator(small_target, head, tree=Chain(2), compile=compile)
    law = exact_law(small_target, sampling["temperature"], sampling["top_k"], 1.0)
    samples, forwards = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3
    assert forwards < 2.8, forwards  # drafts were accepted (3 forwards per call without any)
