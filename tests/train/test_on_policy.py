"""The on-policy stage (train.stage=on-policy): the target verifies the head's own drafts (never the data's
tokens), the accepted length and the loss by hand, and a stage run that continues a trained head and
resumes exactly."""
from __future__ import annotations

import logging

import pytest
import torch
from support.targets import make_tiny_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.heads import build_head
from draftsmith.target.model import target_forward
from draftsmith.train.config import load_config
from draftsmith.train.run import setup
from draftsmith.train.objectives import objective_class
from draftsmith.train.on_policy import Rollout, verify_drafts


def test_accepted_length_counts_the_leading_drafts_the_target_agrees_with():
    drafts = torch.tensor([[[5, 6, 7], [5, 6, 7]]])
    top1 = torch.tensor([[[5, 9, 7], [5, 6, 7]]])
    rollout = Rollout(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool), drafts, torch.zeros(1, 2, 3, 4), top1)
    # chain 0: 5 accepted, 6 rejected (n = 1) -> k - n = -1, 0, 1; chain 1: all accepted (n = 3)
    assert rollout.since_rejection().tolist() == [[[-1, 0, 1], [-3, -2, -1]]]


def test_the_target_verifies_the_drafted_context_not_the_datas_tokens():
    target = make_tiny_target("llama")
    ids = torch.randint(3, 96, (2, 12))
    roots = torch.tensor([[3, 7], [2, 5]])
    drafts = torch.randint(3, 96, (2, 2, 3))
    logits = verify_drafts(target, ids, roots, drafts)  # (2, 2, 3, 96)
    for b in range(2):
        for n in range(2):
            r = int(roots[b, n])
            row = torch.cat([ids[b, : r + 1], drafts[b, n, :2]])[None]  # context to the root, then the drafts
            expected = target_forward(target, row).logits[0, r:]  # laws of tokens r+1, r+2, r+3
            torch.testing.assert_close(logits[b, n], expected, atol=1e-4, rtol=1e-4)
    changed = ids.clone()
    changed[:, 8:] = 3  # the data after every root's chain context: must not be read
    torch.testing.assert_close(verify_drafts(target, changed, roots, drafts), logits)


@pytest.mark.parametrize("kind, options, overrides", [
    ("dflash", {"block_size": 4, "num_layers": 1, "initializer_range": 1.0}, ["head.block_size=4"]),
    ("eagle3", {"initializer_range": 1.0}, ["head.ttt_steps=3"]),  # a head whose drafts follow its inputs
])
def test_a_chain_reads_only_the_data_up_to_its_root(kind, options, overrides):
    """Changing the data's tokens after a chain's root changes neither the chain's drafts nor its loss: the
    head and the target see the head's own drafts there (a step that leaked the data's tokens would)."""
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = build_head(kind, target, **options)
    cfg = load_config(None, [f"head.kind={kind}", *overrides, "train.stage=on-policy", "train.init_from=x",
                             "train.anchors_per_document=1"])
    objective = objective_class(kind)(head, cfg)
    ids = torch.randint(3, 96, (1, 16))
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:7] = 1  # the only root: token 5 (its first label, 6, is a training target)

    def run(input_ids, after_rejection=None):
        features = objective.features(target, {"input_ids": input_ids, "loss_mask": loss_mask}, head)
        objective.perturb(features, cfg, seed=0)
        objective.rollout(features, target, cfg, seed=0)
        if after_rejection is not None:  # DFlash's positions after a rejection read the data's law on purpose
            features.rollout.after_rejection = after_rejection
        return features.rollout, objective(features, target.get_output_embeddings())

    rollout, out = run(ids)
    assert rollout.roots.tolist() == [[5]]
    changed = ids.clone()
    changed[0, 7:] = (ids[0, 7:] + 1) % 93 + 3  # every token after the root's first label differs
    changed[0, 6] = (ids[0, 6] + 1) % 93 + 3  # and the first label too: the chain drafts it
    rollout2, out2 = run(changed, rollout.after_rejection)
    if kind == "eagle3":  # teacher-forced, the chain at position 4 would read the changed tokens and differ
        forced = [objective.draft_top1(head, objective.features(target, {"input_ids": x, "loss_mask": loss_mask}, head),
                                       3)[:, 0, 4] for x in (ids, changed)]
        assert not torch.equal(*forced), forced
    assert torch.equal(rollout.drafts, rollout2.drafts)
    torch.testing.assert_close(rollout.target_logp, rollout2.target_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, out2.loss, atol=1e-5, rtol=1e-5)
    assert out.count.sum() == rollout.drafts.shape[-1]  # one chain, every position scored


def test_a_dflash_block_trains_after_its_first_rejection_against_the_supervised_law():
    """The block never reads its drafts: a position after the first rejection is scored against the target's
    law after the data's prefix (token r+1+k given input_ids[:r+1+k]), never the verifier's law after the
    wrong drafts (which the block cannot condition on, and which simulated tau does not score)."""
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=4, num_layers=1, initializer_range=1.0)
    cfg = load_config(None, ["head.kind=dflash", "head.block_size=4", "train.stage=on-policy", "train.init_from=x",
                             "train.anchors_per_document=2"])
    objective = objective_class("dflash", head.config.variant)(head, cfg)
    ids = torch.randint(3, 96, (1, 16))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    objective.perturb(features, cfg, seed=0)
    objective.rollout(features, target, cfg, seed=0)
    r = features.rollout
    for n, root in enumerate(r.roots[0].tolist()):
        for k in range(3):
            if root + 1 + k < 16:  # the law of token root+1+k after the data's prefix, by hand
                expected = target_forward(target, ids[:, : root + 1 + k]).logits[0, -1].float().softmax(-1)
                torch.testing.assert_close(r.after_rejection[0, n, k].exp(), expected, atol=1e-5, rtol=1e-4)
    r.drafts[0, 0, 0] = r.target_top1[0, 0, 0]  # chain 0's first draft accepted (its law does not read drafts)
    since = r.since_rejection()
    assert (since >= 0).any() and (since < 0).any(), since  # both kinds of position are scored
    lm_head = target.get_output_embeddings()
    loss = objective(features, lm_head).loss
    garbled = r.target_logp.clone()
    garbled[since >= 0] = torch.randn_like(garbled[since >= 0]).log_softmax(-1)  # the law after wrong drafts
    r.target_logp = garbled
    torch.testing.assert_close(objective(features, lm_head).loss, loss)
    r.after_rejection = r.after_rejection.flip(-1)  # what it does read
    assert not torch.allclose(objective(features, lm_head).loss, loss)


@pytest.mark.parametrize("kind, extra", [
    ("dflash", ["head.block_size=4", "head.num_layers=1"]),
    ("eagle3", ["head.ttt_steps=2"]),
])
def test_the_on_policy_stage_continues_a_head_and_resumes_exactly(tiny_files, tmp_path, kind, extra):  # noqa: F811
    base = setup(tiny_config(tiny_files, tmp_path / "supervised", f"head.kind={kind}", *extra, "train.max_steps=4",
                             "train.lr=1e-2", "data.eval=null"))
    stage = [f"head.kind={kind}", *extra, "train.stage=on-policy", f"train.init_from={base.output_dir}",
             "train.anchors_per_document=4", "train.max_steps=4", "train.decay=constant", "train.log_every=1",
             "train.lr=3e-3", "data.eval=null"]
    straight = setup(tiny_config(tiny_files, tmp_path / "straight", *stage))
    records = [r for r in straight.history if "loss" in r]
    assert all(len(r["train_accept"]) == len(r["train_acc"]) and all(0 <= a <= 1 for a in r["train_accept"])
               for r in records), records
    half = setup(tiny_config(tiny_files, tmp_path / "resumed", *stage, "train.max_steps=2", "train.save_every=2"))
    assert half.steps == 2
    resumed = setup(tiny_config(tiny_files, tmp_path / "resumed", *stage, "resume_from=latest"))
    assert resumed.steps == 4
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    moved = any(not torch.equal(a, b) for a, b in zip(base.head.state_dict().values(),
                                                       straight.head.state_dict().values()))
    assert moved  # the stage trained the head it started from


def test_the_stage_reads_stored_features_like_any_run(tiny_files, tmp_path, caplog):  # noqa: F811
    """Online and from a feature dump (scripts/dump_features.py + data.features), the stage's losses agree: the
    head's context comes from the store, the verification of its drafts from the target."""
    from draftsmith.scripts.dump_features import main as dump_main

    extra = ["head.kind=dflash", "head.block_size=4", "head.num_layers=1", "data.eval=null", "train.log_every=1"]
    base = setup(tiny_config(tiny_files, tmp_path / "supervised", *extra, "train.max_steps=3", "train.lr=1e-2"))
    stage = [*extra, "train.stage=on-policy", f"train.init_from={base.output_dir}", "train.max_steps=3",
             "train.anchors_per_document=4"]
    online = setup(tiny_config(tiny_files, tmp_path / "online", *stage))
    store = tmp_path / "features"
    cfg = tiny_config(tiny_files, tmp_path / "offline", *stage, f"data.features={store}")
    (tmp_path / "cfg.yaml").write_text(cfg.to_yaml())
    assert dump_main(["--config", str(tmp_path / "cfg.yaml"), "--out", str(store), "--dtype", "float32",
                      "data.features=null"]) == 0
    caplog.set_level(logging.INFO, logger="draftsmith.train")
    offline = setup(cfg)
    assert "3 micro-batches read from stored features, 0 run through the target" in caplog.text
    losses = [[r["loss"] for r in result.history if "loss" in r] for result in (online, offline)]
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-4)
