"""DSpark (``head.variant=dspark``): its loss by hand (DeepSpec's CE + L1 + confidence BCE, slot k drafting
a+k+1), the Markov bias changing the walk, adaptive verification cutting rows' drafts by their confidence
(and a planted threshold caught), greedy output identical to HF's (attention targets, compiled, a
Qwen3.5-style hybrid, batches with left padding checked row by row, a briefly trained head), sampling
keeping the target's law (chi-square)."""
from __future__ import annotations

import math
import random

import pytest
import torch
from support.targets import ARCHES, make_tiny_target
from support.dflash_infer import assert_loads_and_decodes_alike, assert_rows_alone, batch_target, fit_dflash, mean_tau_of_identical_decodes, successor_training_data, perturbed
from support.sampling import exact_law, joint_pvalue, sample_triples, small_target  # noqa: F401  (fixture)
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.heads.variants.dspark import confident_lengths, corrected
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.infer.drafters.variants.dspark import markov_walk
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.objectives import objective_class
from draftsmith.train.objectives.dflash import block_outputs, sequence_context
from draftsmith.train.objectives.variants.dspark import CE_ALPHA, CONFIDENCE_ALPHA, L1_ALPHA

VOCAB = 96
SMALL = {"block_size": 4, "num_layers": 1, "markov_rank": 8, "variant": "dspark"}


def _gen(target, head, tree, threshold=None, compile=False):
    """A generator drafting ``tree`` with the DSpark drafter at confidence ``threshold`` (None: the default)."""
    return SpeculativeGenerator(target, make_drafter(head, target, tree, confidence=threshold), compile=compile)


def _moved(head, seed: int = 5, scale: float = 0.5):
    """A DSpark head whose Markov bias and confidence matter: every weight perturbed, the Markov factors large."""
    return perturbed(head, lambda n: "markov" in n, seed, scale)


def _drafts(target, head, threshold: float | None, chain: int = 3, rows: int = 4):
    """Each of ``rows`` rows' draft (a batch, on random features)."""
    drafter = make_drafter(head, target, Chain(chain), confidence=threshold)
    width = len(head.feature_layer_ids) * target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    states = drafter.new_rows([torch.zeros(1, 12, dtype=torch.long)] * rows, [12] * rows)
    drafter.observe_rows(states, [torch.randn(1, 6 + b, width, generator=gen) for b in range(rows)],
                         [torch.randint(3, VOCAB, (1, 6 + b), generator=gen) for b in range(rows)])
    roots = [torch.tensor(10 + b) for b in range(rows)]
    return [d.tokens for d in drafter.propose_rows(states, roots, Sampling(), [chain] * rows)]


def test_confident_lengths_by_hand():
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0], [-0.5, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    assert confident_lengths(logits, 0.5).tolist() == [2, 0, 4]
    assert confident_lengths(logits, 0.8).tolist() == [1, 0, 0]  # sigmoid(1) = 0.73 < 0.8
    assert confident_lengths(logits, 0.0).tolist() == [4, 4, 4]


def test_adaptive_verification_cuts_rows_by_their_confidence():
    """Rows keep different numbers of drafts under a threshold, all of them at threshold 0; a confidence head
    pushed far down (a planted bias) keeps none, far up keeps every draft."""
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    full = _drafts(target, head, 0.0)
    assert [t.numel() for t in full] == [4] * 4
    cut = _drafts(target, head, 0.3)
    assert len({t.numel() for t in cut}) > 1, [t.tolist() for t in cut]  # rows verify different lengths
    assert all(torch.equal(c, f[: c.numel()]) for c, f in zip(cut, full))  # a prefix of the same walk
    with torch.no_grad():
        head.confidence_head.proj.bias.fill_(-50.0)
        assert [t.numel() for t in _drafts(target, head, 0.5)] == [1] * 4  # the root alone
        head.confidence_head.proj.bias.fill_(50.0)
        assert [t.numel() for t in _drafts(target, head, 0.5)] == [4] * 4


def test_the_markov_bias_changes_the_walk():
    """With its Markov head zeroed a DSpark drafts each slot's argmax; with it, another walk (the check of the
    identity tests below, that the bias is really applied)."""
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    moved = _drafts(target, head, 0.0)
    with torch.no_grad():
        head.markov_head.markov_w2.weight.zero_()
    assert any(not torch.equal(a, b) for a, b in zip(moved, _drafts(target, head, 0.0)))


@pytest.mark.parametrize("greedy", [True, False])
def test_the_walk_is_the_training_formula_on_its_own_drafts(greedy):
    """Slot by slot, the drafter's Markov walk is the training formula (``dspark_loss``'s ``corrected`` over each slot's
    previous token) with the root and the slots drafted before it as those tokens: each draft (greedy) or law
    (sampled) and each confidence logit. A walk that reads the root as every slot's previous token fails here."""
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 4, target.config.hidden_size, generator=gen)
    logits, root = torch.randn(3, 4, VOCAB, generator=gen), torch.tensor([5, 17, 40])
    sampling = Sampling() if greedy else Sampling(temperature=1.0)
    with torch.no_grad():
        tokens, laws, confidence = markov_walk(head, hidden, logits, root, sampling)
        previous = torch.cat([root[:, None], tokens[:, :-1]], 1)
        formula = corrected(head.markov_head, head.confidence_head, hidden, logits, previous)
        from_root = corrected(head.markov_head, head.confidence_head, hidden, logits, root[:, None].expand(-1, 4))
    for k in range(4):
        if greedy:
            assert torch.equal(tokens[:, k], formula.logits[:, k].argmax(-1)), k
        else:
            torch.testing.assert_close(laws[:, k], formula.logits[:, k].softmax(-1))
        torch.testing.assert_close(confidence[:, k], formula.confidence[:, k])
    assert not torch.equal(formula.logits[:, 1:].argmax(-1), from_root.logits[:, 1:].argmax(-1))  # the check can fail


def test_the_loss_by_hand():
    """DeepSpec's loss from the block outputs: slot k of the block at anchor a, with the Markov bias of the data's
    token a+k, against the target's law at a+k, weighted exp(-k/gamma)."""
    target = make_tiny_target("llama", num_layers=6, initializer_range=0.3)
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL), scale=0.1)
    cfg = load_config(None, ["head.kind=dflash", "head.variant=dspark", "train.gamma=2"])
    objective = objective_class("dflash", head.config.variant)(head, cfg)
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a cut run: row 1's blocks stop training at token 8
    f = objective.features(target, {"input_ids": ids, "loss_mask": mask}, head)
    objective.perturb(f, cfg, seed=0)
    lm_head = target.get_output_embeddings()
    with torch.no_grad():
        loss = objective(f, lm_head).loss
        out = block_outputs(head, f, f.anchors, sequence_context(head, f))
    terms, total = [0.0, 0.0, 0.0], 0.0
    for b, n in f.anchor_keep.nonzero().tolist():
        a = int(f.anchors[b, n])
        for k in range(4):
            if a + k + 1 >= 14 or not mask[b, a: a + k + 2].all():
                break
            with torch.no_grad():
                w1 = head.markov_head.markov_w1.weight[ids[b, a + k]]
                logits = lm_head(out[b, n, k]).float() + head.markov_head.markov_w2(w1).float()
                conf = head.confidence_head.proj(torch.cat([out[b, n, k], w1])).squeeze()
            p, q = f.targets.probs[b, a + k], logits.softmax(-1)
            accept = torch.minimum(p, q).sum()
            w = math.exp(-k / 2)
            terms[0] += w * float(-(p * logits.log_softmax(-1)).sum())
            terms[1] += w * float((q - p).abs().sum())
            terms[2] += w * float(torch.nn.functional.binary_cross_entropy_with_logits(conf, accept))
            total += w
    expected = (CE_ALPHA * terms[0] + L1_ALPHA * terms[1] + CONFIDENCE_ALPHA * terms[2]) / total
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-4, atol=1e-5)


# aot_eager traces the DSpark drafter's path, which is the kind's, not the family's (the eager cases run
# every family): the traced cases of test_dflash_infer, test_dflash2 and test_dspark cover each family and
# each kind once (llama, mistral: DFlash; qwen2: DFlash2; qwen3: DSpark), not the full 4 x 3 grid
@pytest.mark.parametrize("arch, compile", [(a, False) for a in ARCHES] + [(a, "aot_eager") for a in ["qwen3"]])
def test_greedy_matches_hf(arch, compile):
    target = make_tiny_target(arch, initializer_range=0.3)
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, **SMALL))
    rng = random.Random(f"dspark-{arch}-{compile}")
    cases = [(Chain(3), 5, 12)] if compile else [(Chain(1), 1, 1), (Chain(4), 6, 1), (Chain(4), 5, 20)]
    for tree, prompt_len, max_new in cases:
        ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(prompt_len)]])
        for threshold in (0.0, 0.5):
            gen = _gen(target, head, tree, threshold, compile)
            assert torch.equal(gen.generate(ids, max_new_tokens=max_new), hf_greedy(target, ids, max_new)), tree


def test_greedy_matches_hf_on_a_qwen35_hybrid():
    from support.hybrids import make_tiny_hybrid
    target = make_tiny_hybrid("qwen3_5_text", seed=0)
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, mask_token_id=90, **SMALL))
    gen = SpeculativeGenerator(target, head)
    for ids, n in ((torch.tensor([[1, 5, 9, 5, 9, 5, 9, 12, 40, 41, 40, 41]]), 30), (torch.tensor([[1]]), 6)):
        assert torch.equal(gen.generate(ids, max_new_tokens=n), hf_greedy(target, ids, n)), ids.shape


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_text"])
def test_a_left_padded_batch_matches_each_row_alone(arch):
    """Eight rows of different lengths, each row's drafts cut by its own confidence: every row's output equals
    HF greedy of that row alone."""
    target = batch_target(arch)
    torch.manual_seed(0)
    assert_rows_alone(target, _moved(build_head("dflash", target, mask_token_id=90, **SMALL)), arch, VOCAB)


def test_a_trained_dspark_is_lossless_and_learns():
    """A short training on the successor target: drafts token-identical to HF greedy with long accepted runs,
    adaptive verification on (the default threshold)."""
    model, seqs = successor_training_data(VOCAB)
    torch.manual_seed(0)
    head = build_head("dflash", model, variant="dspark", block_size=5, num_layers=2, markov_rank=16)
    head = fit_dflash(model, seqs, head, 250, "head.variant=dspark")
    gen = SpeculativeGenerator(model, head, tree=Chain(5))
    assert mean_tau_of_identical_decodes(model, gen, VOCAB) > 1.5


@pytest.mark.slow  # as tests/infer/test_infer_sampling.py's
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_first_tokens_follow_the_target_law(small_target, threshold):  # noqa: F811
    """Sampling each slot from its Markov-corrected law (and cutting rows by confidence) keeps the target's law."""
    sampling = {"temperature": 0.9, "top_k": 6}
    torch.manual_seed(1)
    head = _moved(build_head("dflash", small_target, variant="dspark", block_size=3, markov_rank=4), scale=0.2)
    gen = _gen(small_target, head, Chain(3), threshold)
    law = exact_law(small_target, sampling["temperature"], sampling["top_k"], 1.0)
    samples, _ = sample_triples(gen, 2000, **sampling)
    assert joint_pvalue(samples, law) > 1e-3


def test_bad_dspark_options_are_one_line():
    with pytest.raises(ConfigError, match="train.loss=lk is not read by head.variant=dspark"):
        load_config(None, ["head.kind=dflash", "head.variant=dspark", "train.loss=lk"])
    with pytest.raises(ConfigError, match="on-policy does not train DSpark's Markov"):
        load_config(None, ["head.kind=dflash", "head.variant=dspark", "train.stage=on-policy", "train.init_from=x"])
    with pytest.raises(ConfigError, match="markov_rank=4 applies only to variant=dspark"):
        load_config(None, ["head.kind=dflash", "head.markov_rank=4"])
    assert load_config(None, ["head.kind=dflash", "head.variant=dspark", "head.markov_rank=4"]).head.markov_rank == 4
    target = make_tiny_target("llama")
    with pytest.raises(ValueError, match="markov_rank=4 applies only to variant=dspark"):
        build_head("dflash", target, markov_rank=4)
    with pytest.raises(ValueError, match="markov_rank=0 must be at least 1"):
        build_head("dflash", target, variant="dspark", markov_rank=0)
    with pytest.raises(ValueError, match="confidence stops EAGLE chains"):
        make_drafter(build_head("dflash", target, block_size=4), target, Chain(2), confidence=0.5)
    with pytest.raises(ValueError, match="confidence=1.5"):
        make_drafter(build_head("dflash", target, variant="dspark", block_size=4), target, Chain(2), confidence=1.5)


@pytest.mark.parametrize("fmt", ["speculators", "dspark"])
def test_export_and_reimport_bit_exactly(fmt, tmp_path):
    """Both DSpark exports read back into the same tensors (AutoHead finds them) and draft the same; z-lab's
    DFlash layout refuses a DSpark; an export with its confidence head's tensors gone is refused by name."""
    from safetensors.torch import load_file, save_file

    from draftsmith.heads import AutoHead
    from draftsmith.heads.formats import export_head, validate_export

    target = make_tiny_target("qwen3", num_layers=6, initializer_range=0.3)
    target.config._name_or_path = "org/tiny"
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, mask_token_id=90, **SMALL))
    out = export_head(head, tmp_path / fmt, fmt, target=target)
    loaded = AutoHead.from_pretrained(out)
    assert_loads_and_decodes_alike(head, loaded, target, "dspark")
    with pytest.raises(ValueError, match="carries no DSpark"):
        export_head(head, tmp_path / "zlab", "dflash", target=target)
    tensors = load_file(out / "model.safetensors")
    del tensors["confidence_head.proj.bias"]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="confidence_head.proj.bias"):
        validate_export(out, fmt)


@pytest.mark.slow  # two runs of the library in its own venv
def test_the_speculators_library_drafts_what_the_head_drafts(tmp_path, capsys):
    """speculators 0.9.0's own DSparkDraftModel loads the export and, on the same target states, computes every
    slot's Markov-corrected logits and confidence as the head does; a Markov factor zeroed in the export (the
    head keeps its own) is a mismatch (skips where the library's venv is not installed, as
    tests/heads/test_check_export.py's library tests)."""
    from support.check_export import check, check_export_plant, export, library

    library()
    target = make_tiny_target("qwen3", num_layers=8)
    target.save_pretrained(tmp_path / "qwen3")
    target.config._name_or_path = str(tmp_path / "qwen3")
    torch.manual_seed(0)
    head = _moved(build_head("dflash", target, mask_token_id=90, **SMALL), scale=0.1)
    out, head_dir = export(tmp_path, head, target)
    code, printed = check(out, head_dir, target, capsys)
    assert code == 0 and "MISMATCH" not in printed and "confidence:" in printed, printed
    assert [line.split(":")[0] for line in printed.splitlines() if "drafted tokens" in line] == \
        [f"block position {k}" for k in range(4)]  # every slot drafts, the anchor's included
    check_export_plant(out, tensor_edit=lambda t: t["markov_head.markov_w2.weight"].zero_())
    code, printed = check(out, head_dir, target, capsys)
    assert code == 1 and "parity: MISMATCH" in printed, printed
