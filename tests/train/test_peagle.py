"""P-EAGLE (``head.variant=peagle`` on EAGLE-3): the drafter's one forward drafts what training computes for the same
rollout, greedy output identical to HF's (an attention target and a Qwen3.5-style hybrid, batches row by row),
sampling keeps the target's law (chi-square), COD sampling by hand, training lowers the loss and the mask inputs
matter (zeroing either changes every mask position and nothing at depth 0), export -> import bit-exact."""
from __future__ import annotations

import random

import pytest
import torch
from support.dflash_infer import hf_greedy
from support.formats import perturb
from support.sampling import exact_law, joint_pvalue, sample_triples, small_target  # noqa: F401  (fixture)
from support.targets import make_successor_target, make_tiny_target

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head, validate_export
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.bench.batch import left_pad
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.objectives import objective_class
from draftsmith.train.objectives.variants.peagle import all_rollouts, cod_rollouts, parallel_outputs

VOCAB = 96
DEPTHS = 4


def _head(target, seed: int = 0, **options):
    torch.manual_seed(seed)
    return perturb(build_head("eagle3", target, variant="peagle", num_depths=DEPTHS, **options)).eval()


def _hybrid():
    from support.hybrids import make_tiny_hybrid
    target = make_tiny_hybrid("qwen3_5_text", seed=0)
    target.generation_config.eos_token_id = None
    return target


def _target(hybrid: bool):
    """The Qwen3.5 hybrid or a tiny Llama, neither stopping at EOS."""
    if hybrid:
        return _hybrid()
    target = make_tiny_target("llama", initializer_range=0.3)
    target.generation_config.eos_token_id = None
    return target


def _features(target, head, ids):
    cfg = load_config(None, ["head.kind=eagle3", "head.variant=peagle", f"head.num_depths={DEPTHS}"])
    objective = objective_class("eagle3", head.config.variant)(head, cfg)
    return objective, cfg, objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)


def test_one_forward_drafts_what_training_computes():
    """After each prefix of a row, the drafter's K laws (one head forward over the pending tokens and K-1 masks,
    over a head cache filled by earlier steps) equal depths 0..K-1 of the training forward at that anchor."""
    target = make_tiny_target("llama", initializer_range=0.3)
    head = _head(target)
    ids = torch.randint(3, VOCAB, (1, 14), generator=torch.Generator().manual_seed(2))
    _, _, f = _features(target, head, ids)
    with torch.no_grad():
        outs = parallel_outputs(head, f.hidden, f.embeds, all_rollouts(f.loss_mask, DEPTHS))
        expected = torch.stack([head.compute_logits(o)[0].float().softmax(-1) for o in outs], 1)  # (T, K, V)
    drafter = make_drafter(head, target, Chain(DEPTHS))
    state = drafter.new_rows([ids[:, :1]], [40])
    seen = 0
    for end in (3, 4, 8, 12):  # steps of 3, 1, 4, 4 accepted tokens
        drafter.observe_rows(state, [f.hidden[:, seen:end]], [ids[:, seen + 1: end + 1]])
        draft = drafter.propose_rows(state, [ids[0, end]], Sampling(temperature=1.0), [DEPTHS])[0]
        torch.testing.assert_close(draft.q, expected[end - 1], msg=f"after {end} tokens")
        seen = end


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5_text"])
def test_greedy_matches_hf(hybrid):
    target = _target(hybrid)
    head = _head(target)
    rng = random.Random(f"peagle-{hybrid}")
    for tree, prompt_len, max_new in [(Chain(1), 1, 3), (Chain(DEPTHS), 6, 20), (None, 5, 12)]:
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(prompt_len)]])
        gen = SpeculativeGenerator(target, make_drafter(head, target, tree))
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), hf_greedy(target, ids, max_new)), tree


@pytest.mark.parametrize("hybrid", [False, True], ids=["llama", "qwen3_5_text"])
def test_a_left_padded_batch_matches_each_row_alone(hybrid):
    target = _target(hybrid)
    head = _head(target)
    rng = random.Random(f"peagle-batch-{hybrid}")
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 9, 4, 12, 2)]
    ids, mask = left_pad(prompts, 0, torch.device("cpu"))
    gen = SpeculativeGenerator(target, make_drafter(head, target, Chain(3)))
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=12)
    for b, prompt in enumerate(prompts):
        assert torch.equal(out[b, ids.shape[1]:], hf_greedy(target, torch.tensor([prompt]), 12)[0, len(prompt):]), b


@pytest.mark.slow  # as tests/infer/test_infer_sampling.py's
def test_first_tokens_follow_the_target_law(small_target):  # noqa: F811
    """Each position sampled from its own law q_d (drafts that do not condition on one another) keeps the target's."""
    sampling = {"temperature": 0.9, "top_k": 6}
    torch.manual_seed(1)
    head = perturb(build_head("eagle3", small_target, variant="peagle", num_depths=3, mask_token_id=7)).eval()
    gen = SpeculativeGenerator(small_target, make_drafter(head, small_target, Chain(3)))
    law = exact_law(small_target, sampling["temperature"], sampling["top_k"], 1.0)
    samples, _ = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3


def test_cod_sampling_by_hand():
    """Depth d keeps int((valid - d) * max(0.7^d, 0.2)) anchors per row, each one whose depth d-1 was kept and whose
    depth-d token is a training target; ratio 1 keeps all of them."""
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 12:] = 0
    rollouts = cod_rollouts(mask, 5, torch.Generator().manual_seed(0))
    alive = [set(range(18)), set(range(10))]  # anchor i's depth-0 token i+2 is trained
    for d, (anchors, valid) in enumerate(rollouts, start=1):
        for b in range(2):
            kept = anchors[b][valid[b]].tolist()
            assert kept == sorted(kept) and len(kept) == int((int(mask[b].sum()) - d) * max(0.7 ** d, 0.2))
            assert set(kept) <= alive[b] and all(mask[b, a + 2 + d] for a in kept)
            alive[b] = set(kept)
    full = cod_rollouts(mask, 3, None, ratio=1.0, floor=1.0)
    assert [a[0][v[0]].tolist() for a, v in full] == [list(range(17)), list(range(16))]


def test_training_lowers_the_loss_and_the_mask_inputs_matter():
    """Forty steps on the successor target lower the loss; zeroing the mask embedding or the shared hidden state
    changes every depth >= 1 output and leaves depth 0 (EAGLE-3's first step) as it was."""
    target = make_successor_target(VOCAB)
    with torch.no_grad():
        ids = hf_greedy(target, torch.randint(3, VOCAB, (8, 3), generator=torch.Generator().manual_seed(0)), 17)
    head = build_head("eagle3", target, variant="peagle", num_depths=DEPTHS)
    objective, cfg, f = _features(target, head, ids)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for step in range(40):
        objective.perturb(f, cfg, seed=step)
        loss = objective(f).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses  # 65.5 -> 51.8 measured
    with torch.no_grad():
        before = parallel_outputs(head, f.hidden, f.embeds, all_rollouts(f.loss_mask, DEPTHS))
        for name in ("mask_embedding", "mask_hidden"):
            saved = getattr(head, name).clone()
            getattr(head, name).zero_()
            after = parallel_outputs(head, f.hidden, f.embeds, all_rollouts(f.loss_mask, DEPTHS))
            getattr(head, name).copy_(saved)
            assert torch.equal(after[0], before[0]), name
            assert all((a - b).abs().amax(-1).min() > 0 for a, b in zip(after[1:], before[1:])), name


def test_export_then_import_is_bit_exact(tmp_path):
    target = make_tiny_target("llama", num_layers=8)
    head = _head(target)
    out = export_head(head, tmp_path / "spec", "speculators", target=target, verifier="org/tiny",
                      num_speculative_tokens=DEPTHS)
    back = AutoHead.from_pretrained(out)
    assert (back.config.variant, back.config.num_depths, back.config.mask_token_id) == ("peagle", DEPTHS, VOCAB - 1)
    mine, theirs = head.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ValueError, match="carries no P-EAGLE"):
        export_head(head, tmp_path / "vllm", "vllm", target=target)
    with pytest.raises(ValueError, match="num_speculative_tokens=5 exceeds this P-EAGLE head's num_depths=4"):
        export_head(head, tmp_path / "five", "speculators", target=target, verifier="org/tiny", num_speculative_tokens=5)


def test_an_export_without_its_p_eagle_parts_is_refused(tmp_path):
    from support.check_export import check_export_plant

    target = make_tiny_target("llama", num_layers=8)
    out = export_head(_head(target), tmp_path / "spec", "speculators", target=target, verifier="org/tiny")
    check_export_plant(out, lambda c: c.pop("mask_token_id"), lambda t: t.pop("mask_hidden"))
    with pytest.raises(ValueError, match=r"mask_token_id=None must be a token id(.|\n)*missing tensors \['mask_hidden'\]"):
        validate_export(out, "speculators")


def test_bad_p_eagle_options_are_one_line():
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match="variant=peagle takes neither fc_norm nor norm_output"):
        build_head("eagle3", target, variant="peagle", fc_norm=True)
    with pytest.raises(ValueError, match="num_depths=3 applies only to variant=peagle"):
        build_head("eagle3", target, num_depths=3)
    with pytest.raises(ConfigError, match="head.variant=peagle trains its depths in one forward"):
        load_config(None, ["head.kind=eagle3", "head.variant=peagle", "train.loss=dpace"])
    head = _head(target)
    with pytest.raises(ValueError, match="the dynamic tree is not implemented for P-EAGLE"):
        make_drafter(head, target, DynamicTree(depth=3, top_k=2, total_tokens=6))
    with pytest.raises(ValueError, match="a chain of 5 exceeds this P-EAGLE head's num_depths=4"):
        make_drafter(head, target, Chain(5))
