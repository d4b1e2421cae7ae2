"""Early-exit (Kangaroo) training: the config key, evaluation's teacher-forced drafts against the
drafter's, a short run of the real loop (loss falls, the head saves, reloads and decodes losslessly)."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target
from support import train_fixtures
from support.train_fixtures import tiny_config

from draftsmith.heads import AutoHead, build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters import Sampling, make_drafter
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.run import setup
from draftsmith.train.objectives import objective_class

tiny_files = train_fixtures.tiny_files  # the fixture: a tiny target and data files


def test_config_key_belongs_to_early_exit():
    cfg = load_config(None, ["head.kind=early-exit", "head.exit_layer=2"])
    assert cfg.head.build_options() == {"exit_layer": 2}
    assert cfg.output_dir.endswith("-early-exit")
    with pytest.raises(ConfigError, match="head.exit_layer applies only to head.kind=early-exit"):
        load_config(None, ["head.kind=eagle3", "head.exit_layer=2"])
    with pytest.raises(ConfigError, match="head.exit_layer must be >= 1, got 0"):
        load_config(None, ["head.kind=early-exit", "head.exit_layer=0"])


def test_evaluation_drafts_what_the_drafter_drafts():
    """Step 0 of evaluation at position i is the drafter's first draft after tokens 0..i+1 (the
    adapter reads the target's layer-k state of token i+1 and its own cache)."""
    target = make_tiny_target("qwen2")
    torch.manual_seed(0)
    head = build_head("early-exit", target, exit_layer=2)
    with torch.no_grad():
        for p in head.self_attn.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    objective = objective_class("early-exit")
    ids = torch.randint(3, 96, (1, 12))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    drafted = objective.draft_top1(head.eval(), features, 2, target.get_output_embeddings())  # (2, 1, 12)
    drafter = make_drafter(head, target, Chain(1))
    for i in range(10):
        states = drafter.new_rows([ids[:, :1]], [ids.shape[1]])  # a batch of one
        drafter.observe_rows(states, [None], [ids[:, 1: i + 2]])
        draft, = drafter.propose_rows(states, [ids[0, i + 1]], Sampling(), [1])
        assert draft.tokens[1:].tolist() == [int(drafted[0, 0, i])], i
    assert torch.equal(drafted[1, 0, :-1], drafted[0, 0, 1:])  # teacher forcing: step 1 = step 0 one later
    assert len(set(drafted[0, 0].tolist())) > 3  # not a constant draft


def test_early_exit_trains_saves_and_reloads(tiny_files, tmp_path):
    result = setup(tiny_config(tiny_files, tmp_path / "run", "head.kind=early-exit", "head.exit_layer=2",
                               "train.lr=1e-2"))
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert len(result.metrics["acc"]) == 4 and 1.0 <= result.metrics["tau"] <= 5
    loaded = AutoHead.from_pretrained(result.output_dir)
    assert loaded.head_kind == "early-exit" and loaded.config.exit_layer == 2
    for (name, a), b in zip(result.head.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert loaded.self_attn.o_proj.weight.abs().sum() > 0  # trained off its layer-skip start
    gen = SpeculativeGenerator.from_pretrained(tiny_files["target"], result.output_dir, device="cpu")
    ids = torch.tensor([[1, 7, 8, 9, 10, 7, 8]])
    ref = gen.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                              pad_token_id=0)
    assert torch.equal(gen.generate(ids, max_new_tokens=16), ref)
