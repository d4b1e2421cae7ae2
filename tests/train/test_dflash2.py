"""DFlash2 (``head.variant=dflash2``): a new DFlash2 drafts exactly what the DFlash it is built from drafts
(and a planted non-zero init is caught); the selector loss by hand; greedy output identical to HF's with a
selector that changes the path (every family, compiled, a tiny hybrid, a briefly trained head); sampling
keeps the target's law; export to z-lab's DFlash2DraftModel and back; the speculators format refuses it."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
from support.targets import ARCHES, make_tiny_target
from support.dflash_infer import fit_dflash, hf_greedy, mean_tau_of_identical_decodes, successor_training_data
from support.sampling import exact_law, joint_pvalue, sample_triples, small_target  # noqa: F401  (fixture)

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.dflash import CandidateSelector, DynamicConv
from draftsmith.heads.formats import export_head, import_dflash, validate_export
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.objectives import objective_class
from draftsmith.train.objectives.dflash import SELECTOR_ALPHA, selector_ce

VOCAB = 96
SMALL = {"block_size": 5, "num_layers": 2, "selector_rank": 8, "selector_top_k": 6}


def _perturbed(head, seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return head.eval()


def _pair(target, seed: int = 0):
    """A (perturbed) DFlash head and a fresh DFlash2 built from it: same weights, new parts at their init."""
    torch.manual_seed(seed)
    dflash = _perturbed(build_head("dflash", target, **{k: SMALL[k] for k in ("block_size", "num_layers")}), seed, 0.3)
    dflash2 = build_head("dflash", target, variant="dflash2", **SMALL).eval()
    missing, unexpected = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected and missing and all("_conv." in k or k.startswith("candidate_selector.") for k in missing)
    return dflash, dflash2


def differences(target, dflash, dflash2) -> list[str]:
    """What a DFlash2 drafts differently from ``dflash``: its block outputs, its selector scores against the
    unary logits, its drafts of one block, greedy generation (tokens and accepted lengths)."""
    found = []
    width = len(dflash.feature_layer_ids) * target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    feats, nxt = torch.randn(1, 9, width, generator=gen), torch.randint(3, VOCAB, (1, 9), generator=gen)
    with torch.no_grad():
        positions = torch.arange(9)[None]
        blocks = torch.randn(1, 2 * dflash.config.block_size, target.config.hidden_size, generator=gen)  # two blocks
        block_pos = torch.arange(9, 9 + 2 * dflash.config.block_size)[None]
        outs = [h(blocks, block_pos, h.context_kv(feats, positions)) for h in (dflash, dflash2)]
        if not torch.equal(*outs):
            found.append("block outputs")
        logits = target.get_output_embeddings()(outs[1]).float()
        unary, candidates = logits.topk(dflash2.selector.top_k, dim=-1)
        previous = torch.randint(3, VOCAB, blocks.shape[:2], generator=gen)  # (1, Q) predecessor tokens
        if not torch.equal(dflash2.selector(outs[1], previous, candidates, unary), unary):
            found.append("selector scores")
        drafts = []
        for head in (dflash, dflash2):
            drafter = make_drafter(head, target, Chain(4))
            states = drafter.new_rows([torch.zeros(1, 12, dtype=torch.long)], [12])
            drafter.observe_rows(states, [feats], [nxt])
            drafts.append(drafter.propose_rows(states, [torch.tensor(17)], Sampling(), [4])[0].tokens)
        if not torch.equal(*drafts):
            found.append("drafts")
    ids = torch.randint(3, VOCAB, (1, 6), generator=gen)
    runs = []
    for head in (dflash, dflash2):
        g = SpeculativeGenerator(target, head, tree=Chain(4))
        runs.append((g.generate(ids, max_new_tokens=24), g.last_stats.tau))
    if not torch.equal(runs[0][0], runs[1][0]) or runs[0][1] != runs[1][1]:
        found.append("generation")
    return found


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_new_dflash2_drafts_what_its_dflash_drafts(arch):
    target = make_tiny_target(arch, initializer_range=0.3)
    target.generation_config.eos_token_id = None
    assert differences(target, *_pair(target)) == []


@pytest.mark.parametrize("planted", ["conv", "selector"])
def test_a_planted_nonzero_init_is_caught(planted, monkeypatch):
    """The check above fails when DFlash2's new parts do not start as no-ops: a kernel projection left at
    its random init, a successor codebook drawn at random."""
    def random_projection(self):
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.normal_(0.0, 0.02)

    def random_successor(self):
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, 1.0)
            self.hidden_projection.weight.normal_(0.0, 1.0)
            self.successor_codebook.normal_(0.0, 1.0)

    if planted == "conv":
        monkeypatch.setattr(DynamicConv, "reset_to_identity", random_projection)
    else:
        monkeypatch.setattr(CandidateSelector, "reset", random_successor)
    target = make_tiny_target("llama", initializer_range=0.3)
    target.generation_config.eos_token_id = None
    found = differences(target, *_pair(target))
    assert ("block outputs" in found) if planted == "conv" else ("selector scores" in found and "drafts" in found), found


def test_selector_cross_entropy_by_hand():
    scores = torch.tensor([[2.0, 0.0, -1.0], [2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    candidates = torch.tensor([[5, 7, 9], [5, 7, 9], [1, 2, 3]])
    gold = torch.tensor([7, 4, 1])
    ce, found = selector_ce(scores, candidates, gold)
    # row 0: -log(e^0 / (e^2 + e^0 + e^-1)); row 1: 4 is no candidate (no loss); row 2: log 3
    assert found.tolist() == [True, False, True]
    torch.testing.assert_close(ce, torch.tensor([math.log(math.exp(2) + 1 + math.exp(-1)), 0.0, math.log(3)]))


def test_the_objective_adds_the_decayed_selector_loss():
    """A fresh DFlash2's loss is its DFlash's plus alpha * sum_k decay^(k-1) * (sum of the selector CE over the
    trained positions whose target token is among the top-k) / (trained positions): its scores are then the
    top-k unary logits, so the CE is recomputed here from the logits alone."""
    target = make_tiny_target("llama", num_layers=6, initializer_range=0.3)
    dflash, dflash2 = _pair(target)
    cfg = load_config(None, ["head.kind=dflash", "train.gamma=2"])
    lm_head = target.get_output_embeddings()
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    ids[:, 8:] = ids[:, :8]  # repeats: some next tokens land in the top-k
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    totals, objectives = [], []
    for head in (dflash, dflash2):
        objective = objective_class("dflash", head.config.variant)(head, cfg)
        features = objective.features(target, batch, head)
        objective.perturb(features, cfg, seed=0)
        with torch.no_grad():
            totals.append(objective(features, lm_head).loss)
        objectives.append((objective, features))
    objective, f = objectives[1]
    from draftsmith.train.objectives.dflash import block_labels, block_outputs, sequence_context
    with torch.no_grad():
        out = block_outputs(dflash2, f, f.anchors, sequence_context(dflash2, f))
    trained = block_labels(f.loss_mask, f.anchors, f.anchor_keep, 5, f.document_ids)
    expected, hits = 0.0, 0
    for k in range(1, 5):
        with torch.no_grad():
            logits = lm_head(out[:, :, k]).float()
        gold = f.top1.gather(1, (f.anchors + k - 1).clamp(max=15))  # the target's greedy token a+k
        top = logits.topk(SMALL["selector_top_k"], dim=-1)
        term = 0.0
        for b, n in trained[..., k].nonzero().tolist():
            if gold[b, n] in top.indices[b, n]:
                hits += 1
                term += float(torch.logsumexp(top.values[b, n], 0) - logits[b, n, gold[b, n]])
        expected += math.exp(-(k - 1) / 2) * term / trained[..., k].sum().item()
    assert hits > 0
    torch.testing.assert_close(totals[1] - totals[0], torch.tensor(SELECTOR_ALPHA * expected), rtol=1e-4, atol=1e-5)


def _selector_moved(head, seed: int = 5):
    """A DFlash2 whose selector changes the walk: successor codebook and context scaled up."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sel = head.selector
        sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=gen))
        sel.hidden_projection.weight.copy_(torch.randn(sel.hidden_projection.weight.shape, generator=gen))
        sel.successor_codebook.copy_(torch.randn(sel.successor_codebook.shape, generator=gen))
        for name, p in head.named_parameters():
            if "kernel_projection" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return head.eval()


# aot_eager traces the DFlash2 drafter's path, which is the kind's, not the family's (the eager cases run
# every family): the traced cases of test_dflash_infer, test_dflash2 and test_dspark cover each family and
# each kind once (llama, mistral: DFlash; qwen2: DFlash2; qwen3: DSpark), not the full 4 x 3 grid
@pytest.mark.parametrize("arch, compile", [(a, False) for a in ARCHES] + [(a, "aot_eager") for a in ["qwen2"]])
def test_greedy_matches_hf_with_a_selector_that_changes_the_path(arch, compile):
    target = make_tiny_target(arch, initializer_range=0.3)
    target.generation_config.eos_token_id = None
    dflash, dflash2 = _pair(target)
    _selector_moved(dflash2)
    rng = random.Random(f"dflash2-{arch}-{compile}")
    cases = [(Chain(3), 5, 12)] if compile else [(Chain(1), 1, 1), (Chain(4), 6, 1), (Chain(4), 5, 20)]
    for tree, prompt_len, max_new in cases:
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(prompt_len)]])
        gen = SpeculativeGenerator(target, dflash2, tree=tree, compile=compile)
        ref = hf_greedy(target, ids, max_new)
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), ref), tree
    eos = int(ref[0, ids.shape[1] + 7])
    assert torch.equal(SpeculativeGenerator(target, dflash2, tree=Chain(3), compile=compile)
                       .generate(ids, max_new_tokens=20, eos_token_id=eos), hf_greedy(target, ids, 20, eos=eos))
    # the selector really walks another path than the unary argmax somewhere
    if not compile:
        assert differences(target, dflash, dflash2) != []


def test_greedy_matches_hf_on_a_tiny_hybrid():
    from support.hybrids import make_tiny_hybrid
    target = make_tiny_hybrid("qwen3_5_text", seed=0)
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = _selector_moved(build_head("dflash", target, variant="dflash2", block_size=4, num_layers=1,
                                      selector_rank=8, selector_top_k=4, mask_token_id=90))
    gen = SpeculativeGenerator(target, head)
    for ids, n in ((torch.tensor([[1, 5, 9, 5, 9, 5, 9, 12, 40, 41, 40, 41]]), 30), (torch.tensor([[1]]), 6)):
        assert torch.equal(gen.generate(ids, max_new_tokens=n), hf_greedy(target, ids, n)), ids.shape


def test_a_trained_dflash2_is_lossless_and_its_selector_learns():
    """A short DFlash2 training on the successor target: the selector's parameters move off their init and
    the drafts stay token-identical to HF greedy with long accepted runs."""
    model, seqs = successor_training_data(VOCAB)
    torch.manual_seed(0)
    head = build_head("dflash", model, variant="dflash2", block_size=5, num_layers=2, selector_rank=16, selector_top_k=8)
    head = fit_dflash(model, seqs, head, 250, "head.variant=dflash2")
    assert head.selector.successor_codebook.abs().sum() > 0
    assert any(p.abs().sum() > 0 for n, p in head.named_parameters() if "kernel_projection" in n)
    gen = SpeculativeGenerator(model, head, tree=Chain(4))
    assert mean_tau_of_identical_decodes(model, gen, VOCAB) > 1.5


@pytest.mark.slow  # as tests/infer/test_infer_sampling.py's
def test_first_tokens_follow_the_target_law(small_target):  # noqa: F811
    """Sampling from the selector's law over the top-k candidates (zero elsewhere) keeps the target's law."""
    sampling = {"temperature": 0.9, "top_k": 6}
    torch.manual_seed(1)
    head = _selector_moved(build_head("dflash", small_target, variant="dflash2", block_size=3, selector_rank=4,
                                      selector_top_k=3))
    gen = SpeculativeGenerator(small_target, head, tree=Chain(2))
    law = exact_law(small_target, sampling["temperature"], sampling["top_k"], 1.0)
    samples, _ = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3


def test_export_to_dflash2_draft_model_and_back(tmp_path):
    target = make_tiny_target("qwen3", num_layers=6, initializer_range=0.3)
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = _selector_moved(build_head("dflash", target, variant="dflash2", **SMALL))
    out = export_head(head, tmp_path / "dflash2", "dflash", target=target)
    validate_export(out, "dflash")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                                           "selector_rank": 8, "selector_top_k": 6}
    loaded = import_dflash(out)
    a, b = head.state_dict(), loaded.state_dict()
    assert loaded.config.variant == "dflash2" and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "candidate_selector.predecessor_codebook" in a  # z-lab's name: no ".weight"
    auto = AutoHead.from_pretrained(out).state_dict()  # --head takes it too (was "not a draftsmith head")
    assert auto.keys() == b.keys() and all(torch.equal(auto[k], b[k]) for k in b)
    ids = torch.tensor([[4, 9, 13]])
    outs = [SpeculativeGenerator(target, h, tree=Chain(3)).generate(ids, max_new_tokens=10) for h in (head, loaded)]
    assert torch.equal(outs[0], outs[1])
    head.save_pretrained(tmp_path / "saved")  # draftsmith's own save keeps the variant
    assert AutoHead.from_pretrained(tmp_path / "saved").config.variant == "dflash2"
    with pytest.raises(ValueError, match="speculators format carries no DFlash2"):
        export_head(head, tmp_path / "spec", "speculators", target=target)


def test_bad_dflash2_options_are_one_line():
    with pytest.raises(ConfigError, match="head.selector_top_k.*variant=dflash2"):
        load_config(None, ["head.kind=dflash", "head.selector_top_k=4"])
    with pytest.raises(ConfigError, match="head.variant"):
        load_config(None, ["head.kind=dflash", "head.variant=dflash3"])
    with pytest.raises(ConfigError, match=r"head.variant applies only to head.kind=eagle3/dflash \(head.kind=medusa\)"):
        load_config(None, ["head.kind=medusa", "head.variant=dflash2"])
    with pytest.raises(ConfigError, match=r"head.variant='dflash2' must be one of eagle3, peagle$"):  # EAGLE-3's own
        load_config(None, ["head.kind=eagle3", "head.variant=dflash2"])
    with pytest.raises(ConfigError, match="on-policy does not train DFlash2's selector"):  # at parse time
        load_config(None, ["head.kind=dflash", "head.variant=dflash2", "train.stage=on-policy",
                           "train.init_from=runs/some-dflash2"])
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match="conv_group_size=16 must divide hidden_size=24"):
        build_head("dflash", make_tiny_target("llama", hidden_size=24, num_heads=2, num_kv_heads=1),
                   variant="dflash2")
    head = build_head("dflash", target, variant="dflash2", block_size=4, selector_top_k=4)
    cfg = load_config(None, ["head.kind=dflash"])
    cfg.train.stage = "on-policy"  # (parse time also wants train.init_from: the objective's check is the one here)
    with pytest.raises(ValueError, match="on-policy does not train DFlash2's selector"):
        objective_class("dflash", head.config.variant)(head, cfg)
