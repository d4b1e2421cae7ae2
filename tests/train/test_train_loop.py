"""The training loop on a tiny random target: TTT semantics, every head kind trains and reloads."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
from support.targets import make_tiny_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from transformers import AutoModelForCausalLM

from draftsmith.heads import AutoHead, HeadCache, build_head
import draftsmith.train.objectives.eagle
from draftsmith import train
from draftsmith.train.config import from_dict, load_config
from draftsmith.train.run import setup
from draftsmith.train.objectives import objective_class
from draftsmith.train.throughput import measure_throughput
from draftsmith.train.unroll import shift_left, ttt_attention_mask, unroll


def test_ttt_attention_mask_pattern():
    mask = ttt_attention_mask(3, 2, torch.float32, torch.device("cpu"))
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 1, 0, 0, 1, 0, 0],  # causal | diag | diag
                       [1, 1, 0, 0, 1, 0, 0, 1, 0],
                       [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    assert mask.min().item() == torch.finfo(torch.float32).min


def test_shift_left():
    x = torch.arange(5.0).view(1, 5, 1)
    assert shift_left(x, 2).flatten().tolist() == [2, 3, 4, 0, 0]
    assert shift_left(x, 7).flatten().tolist() == [0, 0, 0, 0, 0]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_unroll_equals_drafting_one_token_at_a_time(kind):
    """Training-time test step k at position i == what the head computes at inference when it
    drafts k tokens after a prefix 0..i whose draft KV came from true features."""
    target = make_tiny_target("llama", num_layers=6)
    head = build_head(kind, target).eval()
    torch.manual_seed(0)
    seq_len, steps, width = 7, 3, 32
    feats = torch.randn(1, seq_len, width * (3 if kind == "eagle3" else 1))
    embeds = torch.randn(1, seq_len, width)  # embeds[:, t] = embedding of token t
    first = head.project(feats) if kind == "eagle3" else feats
    with torch.no_grad():
        parallel = list(unroll(head, first, embeds, steps))  # step k: (1, T, H)
        for i in range(seq_len - 1 - steps):
            cache = HeadCache()
            out = head(hidden_states=first[:, : i + 1], inputs_embeds=embeds[:, 1: i + 2],
                       position_ids=torch.arange(i + 1)[None], past_key_values=cache).hidden_states
            torch.testing.assert_close(out[:, i], parallel[0][:, i])
            hidden = out[:, i: i + 1]
            for k in range(1, steps):  # one new token at position i+k, attending to the whole cache
                hidden = head(hidden_states=hidden, inputs_embeds=embeds[:, i + 1 + k: i + 2 + k],
                              position_ids=torch.tensor([[i + k]]), past_key_values=cache).hidden_states
                torch.testing.assert_close(hidden[:, 0], parallel[k][:, i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, extra", [
    ("medusa", ["head.num_heads=3", "train.lr=1e-2"]),
    ("eagle", []),
    ("eagle3", ["head.draft_vocab_size=128", "head.ttt_steps=3"]),
])
def test_each_head_kind_trains_saves_and_reloads(tiny_files, tmp_path, kind, extra):
    cfg = tiny_config(tiny_files, tmp_path / kind, f"head.kind={kind}", *extra)
    result = setup(cfg)

    losses = [r["loss"] for r in result.history if "loss" in r]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert result.steps == 12 and result.tokens_per_second > 0
    depth = {"medusa": 3, "eagle": 7, "eagle3": 3}[kind]
    assert len(result.metrics["acc"]) == depth and 1.0 <= result.metrics["tau"] <= 1 + depth

    out = result.output_dir
    loaded = AutoHead.from_pretrained(out)
    assert type(loaded) is type(result.head) and loaded.head_kind == kind
    head = result.head.cpu()  # trained on the accelerator's device (CUDA where there is one)
    trained = head.state_dict()
    assert trained.keys() == loaded.state_dict().keys()
    assert all(torch.equal(trained[k], v) for k, v in loaded.state_dict().items())
    if kind == "eagle3":
        assert loaded.config.draft_vocab_size == 128 and int(loaded.t2d.sum()) == 128
        assert 0 < result.metrics["draft_vocab_coverage"] < 1

    # the reloaded head drafts exactly what the trained one does
    tgt = AutoModelForCausalLM.from_pretrained(tiny_files["target"]).eval()
    ids = torch.randint(5, 300, (1, 16))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    objective = objective_class(kind)
    features = objective.features(tgt, batch, loaded, need_top1=True)
    lm_head = tgt.get_output_embeddings()
    assert torch.equal(objective.draft_top1(head.eval(), features, 2, lm_head),
                       objective.draft_top1(loaded, features, 2, lm_head))

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [3, 6, 9, 12]
    assert [r["step"] for r in records if "tau" in r] == [6, 12]
    assert from_dict(yaml.safe_load((out / "config.yaml").read_text())) == cfg
    card = (out / "README.md").read_text()
    assert "draft head for" in card and f"simulated τ {result.metrics['tau']:.3f}" in card
    assert "best/" in card and "examples out 24" in card  # this run's results and data summary
    assert (out / "best" / "config.json").is_file()
    assert not (out / "checkpoints").exists()  # save_every=0


def test_measure_throughput(tiny_files, tmp_path):
    cfg = tiny_config(tiny_files, tmp_path / "tp", "head.kind=eagle3", "head.ttt_steps=2", "data.eval=null")
    result = measure_throughput(cfg, steps=2, warmup=1)
    assert result["head_kind"] == "eagle3"
    assert result["train_tokens_per_s"] > 0 and result["target_forward_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["train_tokens_per_s"] / result["target_forward_tokens_per_s"])
    assert not (tmp_path / "tp").exists()  # measuring writes no run directory


def test_eagle_feature_noise_reaches_the_input_only(monkeypatch):
    target = make_tiny_target("llama", num_layers=6)
    head = build_head("eagle", target)
    objective = objective_class("eagle")(head, load_config(None, ["head.kind=eagle"]))
    ids = torch.randint(3, 96, (2, 10))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    seen = []
    real = train.objectives.eagle.eagle_loss

    def spy(pred_hidden, pred_logits, target_hidden, *args, **kwargs):
        seen.append((pred_hidden.detach(), target_hidden))
        return real(pred_hidden, pred_logits, target_hidden, *args, **kwargs)

    monkeypatch.setattr(train.objectives.eagle, "eagle_loss", spy)
    lm_head = target.get_output_embeddings()
    objective(features, lm_head)
    features.noise = 0.1 * torch.ones_like(features.hidden)
    objective(features, lm_head)
    (clean_pred, clean_target), (noisy_pred, noisy_target) = seen
    assert noisy_target is features.hidden and torch.equal(clean_target, noisy_target)
    assert not torch.allclose(clean_pred, noisy_pred)


@pytest.mark.parametrize("init", [True, False])
def test_eagle3_run_starts_from_the_targets_output_layer(tiny_files, tmp_path, init):
    from accelerate import Accelerator

    from draftsmith.train.run import prepare_run

    overrides = ["head.kind=eagle3", "head.draft_vocab_size=64", f"head.init_from_target={str(init).lower()}"]
    cfg = tiny_config(tiny_files, tmp_path / "e3", *overrides)
    run = prepare_run(Accelerator(cpu=True), cfg, str(tiny_files["target"]))
    rows = run.target.lm_head.weight[run.head.draft_vocab_ids()]  # the chosen draft vocabulary, not ids 0..63
    assert not torch.equal(run.head.draft_vocab_ids(), torch.arange(64))
    assert torch.equal(run.head.lm_head.weight, rows) is init
