"""The MTP objective's settings and loss: multi-step cross-entropy whose step k weighs beta^k, beta = 0.6 unless
train.loss_decay is set (FastMTP, speculators), 3 unrolled steps unless head.ttt_steps is set; head.init and
head.num_mtp_layers are MTP keys only."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.objectives import objective_class
from draftsmith.train.objectives.mtp import MTP_STEP_DECAY, MTP_STEPS


def test_defaults_and_explicit_settings():
    cfg = load_config(None, ["head.kind=mtp"])
    assert (cfg.train.loss_decay, cfg.head.ttt_steps) == (MTP_STEP_DECAY, MTP_STEPS) == (0.6, 3)
    cfg = load_config(None, ["head.kind=mtp", "train.loss_decay=0.9", "head.ttt_steps=2", "head.init=fresh"])
    assert (cfg.train.loss_decay, cfg.head.ttt_steps, cfg.head.build_options()) == (0.9, 2, {"init": "fresh"})
    assert load_config(None, ["head.kind=eagle3"]).train.loss_decay == 0.8  # other kinds keep theirs


@pytest.mark.parametrize("key", ["head.init=native", "head.num_mtp_layers=1"])
def test_mtp_keys_are_refused_for_other_kinds(key):
    with pytest.raises(ConfigError, match=rf"^{key.split('=')[0]} applies only to head.kind=mtp "):
        load_config(None, ["head.kind=eagle3", key])


def test_the_loss_is_the_decayed_sum_of_its_steps():
    target = make_tiny_target("llama", num_layers=2)
    torch.manual_seed(0)
    head = build_head("mtp", target)
    cfg = load_config(None, ["head.kind=mtp"])
    cls = objective_class("mtp")
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    features = cls.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    out = cls(head, cfg)(features, target.get_output_embeddings())
    assert out.step_losses.shape == (3,)
    torch.testing.assert_close(out.loss, sum(0.6 ** k * out.step_losses[k] for k in range(3)))
    assert [p for p in cls(head, cfg).param_groups()[0]["params"]] == list(head.parameters())  # the target stays out


def test_top1_labels_train_on_the_targets_argmax():
    """train.labels=top1 (as EAGLE-3's): each step's label is the target's top-1, one-hot."""
    import dataclasses

    import torch.nn.functional as F

    target = make_tiny_target("llama", num_layers=2)
    torch.manual_seed(0)
    head = build_head("mtp", target)
    cls = objective_class("mtp")
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    features = cls.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    lm_head = target.get_output_embeddings()
    soft = cls(head, load_config(None, ["head.kind=mtp"]))
    top1 = cls(head, load_config(None, ["head.kind=mtp", "train.labels=top1"]))(features, lm_head)
    probs = features.targets.probs
    one_hot = F.one_hot(probs.argmax(-1), probs.shape[-1]).to(probs.dtype)
    want = soft(dataclasses.replace(features, targets=features.targets._replace(probs=one_hot)), lm_head)
    torch.testing.assert_close(top1.loss, want.loss)
    assert (top1.loss - soft(features, lm_head).loss).abs() > 1e-3
