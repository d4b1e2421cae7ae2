"""Every shipped config parses, starts with the command that runs it, and round-trips."""
from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.train.config import TrainConfig, from_dict, load_config
from support.house import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"demo.yaml", "llama3.1-8b-eagle3.yaml", "qwen3-8b-eagle3.yaml", "llama3.1-8b-medusa.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_and_round_trips(path):
    cfg = load_config(path)
    assert isinstance(cfg, TrainConfig)
    assert from_dict(cfg.to_dict()) == cfg  # the resolved YAML written to output_dir reloads as is


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_starts_with_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# accelerate launch ") and "train/train_head.py" in first
    if path.name != "demo.yaml":
        assert f"--config configs/{path.name}" in first


def test_realistic_configs_use_the_reference_recipe():
    for name in ("llama3.1-8b-eagle3.yaml", "qwen3-8b-eagle3.yaml"):
        cfg = load_config(CONFIGS[0].parent / name)
        assert (cfg.head.kind, cfg.head.ttt_steps, cfg.head.draft_vocab_size) == ("eagle3", 7, 32000)
        assert (cfg.train.lr, cfg.train.betas, cfg.train.max_grad_norm) == (5e-5, (0.9, 0.95), 0.5)
        assert cfg.train.mixed_precision == "bf16"
    medusa = load_config(CONFIGS[0].parent / "llama3.1-8b-medusa.yaml")
    assert (medusa.head.kind, medusa.head.num_heads) == ("medusa", 4)


@pytest.mark.parametrize("name, kind", [("demo.yaml", "eagle3"), ("demo-eagle.yaml", "eagle"), ("demo-medusa.yaml", "medusa"),
                                        ("demo-dflash.yaml", "dflash"), ("demo-dspark.yaml", "dflash"),
                                        ("demo-early-exit.yaml", "early-exit")])
def test_demo_configs_share_data_and_budget(name, kind):
    """Every demo config reads the same stdlib splits; the main job's (demo.yaml) has the target regenerate
    them first (data.self_distill) and trains 300 steps, the others train 400 on the text as it is."""
    cfg = load_config(CONFIGS[0].parent / name)
    demo = load_config(CONFIGS[0].parent / "demo.yaml")
    assert cfg.head.kind == kind and cfg.target == "demo:tiny"
    source = ("train", "eval", "max_length", "eval_rows")
    assert [getattr(cfg.data, k) for k in source] == [getattr(demo.data, k) for k in source]
    assert cfg.train.micro_batch_size == 4
    if kind == "eagle3":
        assert cfg.head.init_from_target is True and cfg.head.draft_vocab_size == 1024
        # the recipe docs/objectives.md measured at this budget ("The ablation at the demo budget")
        assert (cfg.head.ttt_steps, cfg.head.norm_output, cfg.train.eval_depth) == (3, True, None)
        # speculators' optimizer and schedule ("speculators' optimizer" there)
        assert (cfg.train.betas, cfg.train.weight_decay, cfg.train.warmup_steps, cfg.train.decay,
                cfg.train.max_grad_norm) == ((0.9, 0.999), 0.01, 3, "linear", 1.0)
        assert cfg.train.labels == "top1"  # greedy verification's event ("Top-1 labels" there)
        assert (cfg.data.self_distill.rows, cfg.train.max_steps) == (768, 300)
        assert cfg.data.self_distill.prompt_tokens + cfg.data.self_distill.max_new_tokens == cfg.data.max_length
    else:
        assert (cfg.data.self_distill.rows, cfg.train.max_steps) == (0, 400)


def test_demo_config_refuses_another_kind_by_name():
    with pytest.raises(ValueError, match="head.draft_vocab_size applies only to head.kind=eagle3"):
        load_config(CONFIGS[0].parent / "demo.yaml", ["head.kind=medusa"])
