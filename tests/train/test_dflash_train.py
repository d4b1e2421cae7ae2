"""DFlash training: anchors and the block mask, a short run of the real loop (loss falls, the head
saves and reloads, evaluation drafts the block), and an exact resume."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.heads import AutoHead, build_head
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.features import Features
from draftsmith.train.run import setup
from draftsmith.train.objectives import objective_class
from draftsmith.train.objectives.dflash import block_mask


def test_block_mask_sees_context_before_its_anchor_and_its_own_block():
    mask = block_mask(torch.tensor([[1, 3]]), seq_len=4, block_size=2, dtype=torch.float32)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 1, 1, 0, 0],  # block at anchor 1: context 0, its own 2 positions
                       [1, 0, 0, 0, 1, 1, 0, 0],
                       [1, 1, 1, 0, 0, 0, 1, 1],  # block at anchor 3: context 0..2
                       [1, 1, 1, 0, 0, 0, 1, 1]]


def test_training_block_equals_the_inference_block(monkeypatch):
    """Evaluation's parallel blocks (every position an anchor, as in training) == what the drafter
    proposes after observing tokens 0..i and rooting at token i+1."""
    monkeypatch.setattr("draftsmith.train.objectives.dflash.EVAL_CHUNK", 5)  # several chunks, the last one short
    from draftsmith.infer import Chain
    from draftsmith.infer.drafters import Sampling, make_drafter

    target = make_tiny_target("qwen3")
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=4, num_layers=2).eval()
    objective = objective_class("dflash")
    ids = torch.randint(3, 96, (1, 12))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    drafted = objective.draft_top1(head, features, 3, target.get_output_embeddings())  # (3, 1, 12)
    drafter = make_drafter(head, target, Chain(3))
    with torch.no_grad():
        for i in range(11):
            states = drafter.new_rows([ids[:, :1]], [ids.shape[1]])  # a batch of one
            drafter.observe_rows(states, [features.hidden[:, : i + 1]], [ids[:, 1: i + 2]])
            draft, = drafter.propose_rows(states, [ids[0, i + 1]], Sampling(), [3])
            assert draft.tokens[1:].tolist() == drafted[:, 0, i].tolist(), i
    assert len(set(drafted.flatten().tolist())) > 3  # not a constant draft


def test_config_keys_belong_to_dflash():
    cfg = load_config(None, ["head.kind=dflash", "head.block_size=8", "head.num_layers=2", "head.aux_layer_ids=[1,3]"])
    assert cfg.head.build_options() == {"block_size": 8, "num_layers": 2, "aux_layer_ids": [1, 3]}
    with pytest.raises(ConfigError, match="head.block_size"):
        load_config(None, ["head.kind=eagle3", "head.block_size=8"])
    with pytest.raises(ConfigError, match="head.block_size must be >= 1"):
        load_config(None, ["head.kind=dflash", "head.block_size=0"])


def test_dflash_trains_saves_reloads_and_resumes(tiny_files, tmp_path):  # noqa: F811
    extra = ["head.kind=dflash", "head.block_size=4", "train.lr=1e-2"]
    result = setup(tiny_config(tiny_files, tmp_path / "run", *extra))
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert len(result.metrics["acc"]) == 3 and 1.0 <= result.metrics["tau"] <= 4
    loaded = AutoHead.from_pretrained(result.output_dir)
    assert type(loaded) is type(result.head) and loaded.config.block_size == 4
    for (name, a), b in zip(result.head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name

    # exact resume: 6 steps, stop, resume to 12 == 12 straight
    half = setup(tiny_config(tiny_files, tmp_path / "resumed", *extra, "train.save_every=6", "train.max_steps=6",
                             "train.warmup_steps=2", "train.decay=constant"))
    assert half.steps == 6
    straight = setup(tiny_config(tiny_files, tmp_path / "straight", *extra, "train.decay=constant"))
    resumed = setup(tiny_config(tiny_files, tmp_path / "resumed", *extra, "train.decay=constant",
                                "resume_from=latest"))
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)


def test_objective_loss_falls_on_a_repeated_batch():
    target = make_tiny_target("llama", initializer_range=0.3)  # peaked next-token laws: room below the start
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=4)
    objective = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash"]))
    ids = torch.randint(3, 96, (2, 24))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    assert isinstance(features, Features) and features.mask_embed.shape == (32,)
    objective.perturb(features, None, seed=1)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        out = objective(features, target.get_output_embeddings())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert out.step_losses.shape == (3,) and out.count.sum() > 0
    assert losses[-1] < 0.8 * losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses


# DFlash under ``accelerate launch`` on 2 CPU processes (DDP, 2 accumulated micro-batches, evaluated, checkpointed,
# its saved head loads with its options): tests/train/test_target_sharding.py's DFlash whole-target run (one launch there
# trains that file's four runs; this file's own launch was ~24 s of the suite).


def test_lk_loss_is_minus_log_expected_acceptance():
    from draftsmith.train.losses import soft_loss

    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.5, 1e-9]]))
    value, count = soft_loss(logits, p, torch.tensor([True, True]), "lk")
    torch.testing.assert_close(value, -torch.log(torch.tensor((0.5 + 0.5) / 2)))  # alphas 0.5 and 0.5
    assert count == 2
    value, _ = soft_loss(logits, p, torch.tensor([True, False]), "lk")
    torch.testing.assert_close(value, -torch.log(torch.tensor(0.5)))
    assert load_config(None, ["head.kind=early-exit", "train.loss=lk"]).train.loss == "lk"  # every kind takes it
    with pytest.raises(ConfigError, match="Medusa-2 keeps its own combined loss"):
        load_config(None, ["head.kind=medusa", "train.loss=lk", "train.backbone_lora_rank=4"])


def test_medusa_lk_scores_head_k_against_the_targets_law_k_plus_one_ahead():
    """Head k at position i drafts token i+k+2: its law is scored against the target's at j = i+1+k."""
    from draftsmith.train.losses import medusa_soft_loss, soft_loss

    torch.manual_seed(0)
    heads, target_logits = torch.randn(2, 1, 6, 5), torch.randn(1, 6, 5)
    mask = torch.ones(1, 6)
    out = medusa_soft_loss(heads, target_logits, mask, 0.5, "lk")
    for k in range(2):
        n = 6 - 2 - k  # positions i = 0 .. n-1 have a label token i+k+2 inside the sequence
        q, p = heads[k][:, :n], target_logits[:, 1 + k: 1 + k + n].softmax(-1)
        rate = torch.minimum(q.softmax(-1), p).sum(-1).mean()
        torch.testing.assert_close(out.step_losses[k], -torch.log(rate))
        assert out.count[k] == n
    torch.testing.assert_close(out.loss, out.step_losses[0] + 0.5 * out.step_losses[1])
    ce, _ = soft_loss(heads[0][:, :4], target_logits[:, 1:5].softmax(-1), mask[:, 2:].bool(), "ce")
    torch.testing.assert_close(medusa_soft_loss(heads, target_logits, mask, 0.5, "ce").step_losses[0], ce)


def test_lk_lambda_mixes_ce_and_acceptance_by_the_acceptance_rate():
    """LK^lambda = w * CE + (1 - w) * (1 - rate), w = exp(-3 rate) with the rate detached (SpecForge's
    script defaults kl_scale 1, kl_decay 3): checked by hand, and its gradient mixes both terms' gradients."""
    from draftsmith.train.losses import soft_loss

    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5], [0.5, 0.5, 1e-9]])).requires_grad_()
    mask = torch.tensor([True, True])
    value, count = soft_loss(logits, p, mask, "lk-lambda")
    rate = torch.tensor(0.5)  # both rows accept with probability 0.5
    ce = -(p * torch.log_softmax(logits.detach(), -1)).sum(-1).mean()
    weight = torch.exp(-3 * rate)
    torch.testing.assert_close(value, weight * ce + (1 - weight) * (1 - rate))
    value.backward()
    lk_grad = torch.autograd.grad(1 - soft_loss(logits, p, mask, "lk")[0].neg().exp(), logits)[0]
    ce_grad = torch.autograd.grad(soft_loss(logits, p, mask, "ce")[0], logits)[0]
    torch.testing.assert_close(logits.grad, weight * ce_grad + (1 - weight) * lk_grad)
    with pytest.raises(ValueError, match="unknown draft loss 'kl'"):
        soft_loss(logits, p, mask, "kl")


@pytest.mark.parametrize("kind, loss, extra", [
    ("dflash", "lk", ["head.block_size=4"]), ("eagle3", "lk", ["head.ttt_steps=2"]),
    ("eagle3", "lk-lambda", ["head.ttt_steps=2"]), ("eagle", "lk", []), ("eagle", "lk-lambda", []),
    ("medusa", "lk", []), ("medusa", "lk-lambda", []),
    ("dflash", "dpace", ["head.block_size=4"]), ("eagle3", "dpace", ["head.ttt_steps=2"]),
])
def test_lk_loss_trains(tiny_files, tmp_path, kind, loss, extra):  # noqa: F811
    """train.loss=lk / lk-lambda / dpace: the loop runs and the loss falls (eagle: SmoothL1 + 0.1 x the LK
    term); eagle3 and dflash log the exact acceptance rate per draft position."""
    result = setup(tiny_config(tiny_files, tmp_path / kind, f"head.kind={kind}", f"train.loss={loss}",
                               "train.lr=1e-2", *extra))
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert all(0 <= x < 100 for x in losses) and losses[-1] < losses[0], losses
    if kind in ("eagle3", "dflash"):
        accept = [r["train_accept"] for r in result.history if "loss" in r]
        assert all(len(a) == len(result.metrics["acc"]) and all(0 < x <= 1 for x in a) for a in accept), accept


def test_bad_head_options_are_one_line_errors_naming_the_value():
    target = make_tiny_target("llama")  # 6 layers, vocab 96
    for options, message in [({"block_size": 1}, "block_size=1"), ({"num_layers": 0}, "num_layers=0"),
                             ({"mask_token_id": 96}, "mask_token_id=96"), ({"aux_layer_ids": [2, 6]}, r"\[6\]")]:
        with pytest.raises(ValueError, match=message) as err:
            build_head("dflash", target, **options)
        assert "\n" not in str(err.value)
    assert build_head("dflash", target, num_layers=3).feature_layer_ids == (2, 3, 4)  # layers 1, 2, 3 + 1
