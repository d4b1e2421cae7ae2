"""Settings of the EAGLE-3 recipe off by default (issue 45's ablation): two of speculators' (positions whose target
top-1 is outside the draft vocabulary trained too, ``train.mask_out_of_vocab=false``; the lm_head kept where it
starts, ``train.freeze_lm_head=true``) and the demo recipe's top-1 labels (``train.labels=top1``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.targets import make_tiny_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from draftsmith.heads import build_head
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.losses import law_inverse_temperature, soft_ce, step_slices
from draftsmith.train.objectives import objective_class
from draftsmith.train.run import setup
from draftsmith.train.unroll import unroll


def _step_losses(mask_out_of_vocab: bool, *overrides: str):
    """(objective output, features, head) of a 2-step EAGLE-3 head whose 12-token draft vocabulary leaves out
    most of the target's top-1s."""
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = build_head("eagle3", target, draft_vocab_size=12)
    head.set_draft_vocab(list(range(3, 15)))
    cfg = load_config(None, ["head.kind=eagle3", "head.ttt_steps=2", f"train.mask_out_of_vocab={mask_out_of_vocab}",
                                *overrides])
    objective = objective_class("eagle3", head.config.variant)(head, cfg)
    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    ids[:, ::2] = torch.arange(3, 11)  # some of the target's top-1s fall inside the draft vocabulary
    loss_mask = torch.ones_like(ids)
    loss_mask[1, 10] = 0
    features = objective.features(target, {"input_ids": ids, "loss_mask": loss_mask}, head)
    return objective(features), features, head


def test_out_of_vocab_positions_train_only_when_asked():
    masked, features, _ = _step_losses(True)
    every, _, head = _step_losses(False)
    in_vocab, loss_mask = features.targets.in_vocab, features.loss_mask.bool()
    for k in range(2):
        pos, tgt, label = step_slices(16, k)
        assert int(masked.count[k]) == int((loss_mask[:, label] & in_vocab[:, tgt]).sum())
        assert int(every.count[k]) == int(loss_mask[:, label].sum()) > int(masked.count[k]) > 0
    with torch.no_grad():  # step 0 by hand: the mean soft CE over every trained position
        pos, tgt, label = step_slices(16, 0)
        logits = head.compute_logits(next(unroll(head, head.project(features.hidden), features.embeds, 1)))
        expected = soft_ce(logits[:, pos], features.targets.probs[:, tgt])[loss_mask[:, label]].mean()
    assert float(every.step_losses[0]) == pytest.approx(float(expected), rel=1e-5)
    assert float(masked.step_losses[0]) != pytest.approx(float(expected), rel=1e-3)


def test_a_frozen_lm_head_stays_the_targets_rows_while_the_rest_trains(tiny_files, tmp_path):
    runs = {}
    for frozen in (True, False):
        cfg = tiny_config(tiny_files, tmp_path / str(frozen), "head.kind=eagle3", "head.ttt_steps=2",
                          "train.max_steps=3", "data.eval=null", "train.warmup_steps=0", "head.init_from_target=true",
                          f"train.freeze_lm_head={frozen}")
        runs[frozen] = setup(cfg).head
    target = AutoModelForCausalLM.from_pretrained(tiny_files["target"])
    for frozen, head in runs.items():
        rows = target.get_output_embeddings().weight.index_select(0, head.draft_vocab_ids().cpu())
        assert torch.equal(head.lm_head.weight.detach().cpu(), rows) == frozen
    assert not runs[True].lm_head.weight.requires_grad and runs[False].lm_head.weight.requires_grad
    assert all(p.requires_grad for name, p in runs[True].named_parameters() if not name.startswith("lm_head."))


@torch.no_grad()
def _step_logits(head, features) -> list:
    """The head's logits at each of its 2 TTT steps over ``features`` (what the losses are computed from)."""
    return [head.compute_logits(out) for out in unroll(head, head.project(features.hidden), features.embeds, 2)]


def test_top1_labels_train_hard_ce_on_the_targets_top1_and_soft_labels_its_law():
    soft, features, head = _step_losses(True)
    top1, _, _ = _step_losses(True, "train.labels=top1")
    in_vocab, loss_mask = features.targets.in_vocab, features.loss_mask.bool()
    step_logits = _step_logits(head, features)
    for k in range(2):
        pos, tgt, label = step_slices(16, k)
        trained = loss_mask[:, label] & in_vocab[:, tgt]
        logits = step_logits[k][:, pos][trained].float()
        probs = features.targets.probs[:, tgt][trained]
        # the target's own top-1 (a target id) as its draft id: the positions trained hold it inside the vocabulary
        labels = head.draft_to_target(probs.argmax(-1))
        assert torch.equal(labels, features.targets.top1[:, tgt][trained])
        assert float(top1.step_losses[k]) == pytest.approx(float(F.cross_entropy(logits, probs.argmax(-1))), rel=1e-5)
        assert float(soft.step_losses[k]) == pytest.approx(float(soft_ce(logits, probs).mean()), rel=1e-5)
        assert abs(float(top1.step_losses[k]) - float(soft.step_losses[k])) > 1e-3  # 0.02 on step 0 here
        assert int(top1.count[k]) == int(soft.count[k]) == int(trained.sum())


def test_top1_labels_without_the_vocab_mask_are_the_top1_inside_the_draft_vocabulary():
    """train.mask_out_of_vocab=false: every loss-masked position trains, and where the target's top-1 lies outside the
    draft vocabulary the label is the top-1 of its law there (renormalised over the draft vocabulary), not the
    target's own top-1 (which has no draft id)."""
    top1, features, head = _step_losses(False, "train.labels=top1")
    in_vocab, loss_mask = features.targets.in_vocab, features.loss_mask.bool()
    step_logits = _step_logits(head, features)
    for k in range(2):
        pos, tgt, label = step_slices(16, k)
        trained = loss_mask[:, label]
        assert (trained & ~in_vocab[:, tgt]).any()  # positions whose own top-1 the draft vocabulary lacks train too
        logits = step_logits[k][:, pos][trained].float()
        probs = features.targets.probs[:, tgt][trained]
        assert float(top1.step_losses[k]) == pytest.approx(float(F.cross_entropy(logits, probs.argmax(-1))), rel=1e-5)
        assert int(top1.count[k]) == int(trained.sum())


def test_a_top1_share_trains_the_same_mix_of_hard_and_soft_ce():
    """train.top1_share=w: each step's loss is w x hard CE on the top-1 + (1 - w) x soft CE, over the same positions."""
    soft, _, _ = _step_losses(True)
    top1, _, _ = _step_losses(True, "train.labels=top1")
    mixed, _, _ = _step_losses(True, "train.top1_share=0.75")
    for k in range(2):
        assert float(mixed.step_losses[k]) == pytest.approx(
            0.25 * float(soft.step_losses[k]) + 0.75 * float(top1.step_losses[k]), rel=1e-5)
        assert int(mixed.count[k]) == int(soft.count[k])


@pytest.mark.parametrize("overrides, message", [
    (["train.top1_share=1"], r"train.top1_share=1.0: the top-1's share is in \(0, 1\)"),
    (["train.top1_share=0"], r"train.top1_share=0.0: the top-1's share is in \(0, 1\)"),
    (["train.labels=top1", "train.top1_share=0.3"], "train.top1_share=0.3 mixes the top-1 into soft labels"),
    (["train.top1_share=0.3", "train.stage=on-policy", "train.init_from=runs/x"], "train.top1_share=0.3 trains the"),
])
def test_a_top1_share_outside_its_range_or_with_top1_labels_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["head.kind=eagle3", *overrides])


def test_top1_labels_are_refused_where_no_loss_reads_them():
    with pytest.raises(ConfigError, match="train.labels=top1 trains the supervised stage"):
        load_config(None, ["head.kind=eagle3", "train.labels=top1", "train.stage=on-policy", "train.init_from=runs/x"])
    with pytest.raises(ConfigError, match="train.labels applies only to head.kind=eagle3"):
        load_config(None, ["head.kind=dflash", "train.labels=top1"])


def test_law_inverse_temperature_is_the_soft_ce_minimum_over_beta():
    """Newton's beta is where soft CE of softmax(beta z) against p is least: a dense grid finds no lower CE, and a
    beta 5% either side is higher."""
    g = torch.Generator().manual_seed(3)
    probs = (torch.randn(40, 30, generator=g) * 1.5).softmax(-1)
    logits = 2.5 * probs.log() + 0.4 * torch.randn(40, 30, generator=g)  # sharper than the law, with noise
    mask = torch.ones(40, dtype=torch.bool)
    mask[::7] = False
    beta = float(law_inverse_temperature(logits, probs, mask))

    def ce(b):
        return float(soft_ce(b * logits[mask], probs[mask]).mean())

    grid = min(ce(b / 1000) for b in range(50, 2000))
    assert 0.2 < beta < 0.8  # about 1 / 2.5
    assert ce(beta) <= grid + 1e-6
    assert ce(beta * 1.05) > ce(beta) and ce(beta / 1.05) > ce(beta)
    assert float(law_inverse_temperature(logits, probs, torch.zeros(40, dtype=torch.bool))) == 1.0


def test_a_law_weight_adds_the_laws_soft_ce_at_the_logits_own_temperature_to_top1_ce():
    """train.law_weight=w with top-1 labels: each step's loss is hard CE on the top-1 + w x soft CE of the law against
    beta x logits, beta the CE's minimiser over the same positions (a loss that ignores the setting, or uses the
    logits untempered, fails)."""
    top1, features, head = _step_losses(True, "train.labels=top1")
    with_law, _, _ = _step_losses(True, "train.labels=top1", "train.law_weight=0.5")
    in_vocab, loss_mask = features.targets.in_vocab, features.loss_mask.bool()
    step_logits = _step_logits(head, features)
    for k in range(2):
        pos, tgt, label = step_slices(16, k)
        trained = loss_mask[:, label] & in_vocab[:, tgt]
        logits, probs = step_logits[k][:, pos][trained].float(), features.targets.probs[:, tgt][trained]
        beta = law_inverse_temperature(logits, probs, torch.ones(len(logits), dtype=torch.bool))
        law = float(soft_ce(beta * logits, probs).mean())
        assert float(with_law.step_losses[k]) == pytest.approx(float(top1.step_losses[k]) + 0.5 * law, rel=1e-5)
        assert abs(law - float(soft_ce(logits, probs).mean())) > 1e-3  # beta moved it
    assert float(with_law.loss.detach()) > float(top1.loss.detach())


@pytest.mark.parametrize("overrides, message", [
    (["train.law_weight=0.5"], "train.law_weight=0.5 adds the law at the logits' own temperature to train.labels=top1"),
    (["train.labels=top1", "train.law_weight=0"], r"train.law_weight=0.0: the law term's weight is > 0"),
    (["train.labels=top1", "train.law_weight=1", "train.loss=dpace"], "train.law_weight=1.0 is not defined with"),
    (["train.labels=top1", "train.law_weight=1", "head.variant=peagle"], "head.variant=peagle does not take it"),
    (["train.law_weight=1", "head.kind=dflash"], "train.law_weight applies only to head.kind=eagle3"),
])
def test_a_law_weight_without_top1_labels_or_out_of_range_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["head.kind=eagle3", *overrides])
