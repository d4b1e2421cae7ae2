"""scripts/cost.py: per-GPU memory with its arithmetic, the FSDP shard, advice when a config does not
fit, feature disk, and targets read without downloading anything."""
from __future__ import annotations

import subprocess
import sys

import pytest

from draftsmith.data.feature_store import bytes_per_token, state_widths
from draftsmith.train.config import load_config
from draftsmith.train.cost import GIB, KNOWN_TARGETS, format_plan, make_plan, shapes, target_config
from support.house import REPO as ROOT

CONFIG_70B = ROOT / "configs" / "llama3.3-70b-eagle3.yaml"


def _llama_counts(c: dict) -> tuple[int, int]:
    """(one decoder layer, embeddings + final norm + lm_head) parameters of a Llama shape, by hand."""
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; two RMS norms
    return layer, 2 * c["vocab_size"] * h + h


def test_parameter_counts_match_a_hand_count():
    cfg = load_config(CONFIG_70B)
    shape = KNOWN_TARGETS[cfg.target]
    s = shapes(cfg, target_config(cfg.target))
    layer, rest = _llama_counts(shape)
    assert (s.one_layer, s.num_layers) == (layer, shape["num_hidden_layers"])
    assert s.target_params == shape["num_hidden_layers"] * layer + rest
    assert s.aux_layers == 3 and s.draft_vocab == 32000 and s.head_params > 0


def test_the_70b_target_is_sharded_over_8_gpus_and_fits_only_so():
    cfg = load_config(CONFIG_70B)
    config = target_config(cfg.target)
    layer, rest = _llama_counts(KNOWN_TARGETS[cfg.target])
    layers = 80 * layer
    sharded = make_plan(cfg, config, gpus=8)
    assert sharded.parts["target"] == pytest.approx((layers / 8 + rest + 2 * layer) * 2)  # bf16, 2 gathered layers
    assert sharded.fits
    whole = make_plan(load_config(CONFIG_70B, ["train.target_sharding=none"]), config, gpus=8)
    assert whole.parts["target"] == pytest.approx((layers + rest) * 2) and not whole.fits
    assert whole.parts["head"] == sharded.parts["head"] and whole.parts["activations"] == sharded.parts["activations"]
    assert any(a.startswith("train.target_sharding=fsdp") for a in whole.advice)
    text = format_plan(cfg, sharded, 8, 1)
    assert f"{sharded.parts['target'] / GIB:.2f} GiB = decoder layers {layers:,} params × 2 B / 8 shards" in text
    assert "fits" in text and "NOT" not in text


def test_more_gpus_shrink_only_the_target_shard():
    cfg = load_config(CONFIG_70B)
    config = target_config(cfg.target)
    eight, sixteen = make_plan(cfg, config, gpus=8), make_plan(cfg, config, gpus=8, nodes=2)
    layers = 80 * _llama_counts(KNOWN_TARGETS[cfg.target])[0]
    assert eight.parts["target"] - sixteen.parts["target"] == pytest.approx(layers * 2 * (1 / 8 - 1 / 16))
    assert sixteen.tokens_per_step == 2 * eight.tokens_per_step


def test_activations_too_large_advise_a_smaller_micro_batch():
    cfg = load_config(CONFIG_70B, ["train.micro_batch_size=64"])
    plan = make_plan(cfg, target_config(cfg.target), gpus=8)
    assert not plan.fits
    advice = [a for a in plan.advice if a.startswith("train.micro_batch_size=")]
    micro = int(advice[0].split()[0].split("=")[1])
    assert 1 <= micro < 64
    smaller = make_plan(load_config(CONFIG_70B, [f"train.micro_batch_size={micro}"]), target_config(cfg.target), 8)
    assert smaller.fits


def test_step_time_and_feature_disk():
    cfg = load_config(CONFIG_70B)
    plan = make_plan(cfg, target_config(cfg.target), gpus=8, tokens_per_s=1000.0, rows=10)
    assert plan.tokens_per_step == 1 * 2048 * 4 * 8
    assert plan.step_seconds == pytest.approx(plan.tokens_per_step / 8000.0)
    # per token: final + 3 aux states of 8192 bf16 values, + 8 B input id + 1 B loss mask (what a dump stores)
    assert plan.disk_bytes == 10 * 2048 * bytes_per_token(state_widths(8192, 3), "bfloat16") == 10 * 2048 * (4 * 8192 * 2 + 9)


def test_feature_bytes_per_token_checks_its_input():
    assert bytes_per_token(state_widths(7, 2), "float32") == 3 * 7 * 4 + 9
    assert bytes_per_token(state_widths(7, 0), "fp8") == 7 + 4 + 9  # one float32 scale per stored vector
    with pytest.raises(ValueError, match="feature dtype 'int4'"):
        bytes_per_token(state_widths(1, 1), "int4")
    with pytest.raises(ValueError, match="widths must be >= 0"):
        bytes_per_token({"final": -1}, "float32")


def test_a_local_target_is_read_from_its_config_json(tmp_path):
    from support.targets import make_tiny_target

    make_tiny_target("qwen3", num_layers=8).config.save_pretrained(tmp_path)
    cfg = load_config(None, [f"target={tmp_path}", "head.kind=eagle3", "data.max_length=32"])
    s = shapes(cfg, target_config(cfg.target))
    assert (s.num_layers, s.hidden, s.vocab) == (8, 32, 96)
    plan = make_plan(cfg, target_config(cfg.target), gpus=1)
    assert plan.world == 1 and plan.parts["target"] == s.target_params * 4  # fp32: mixed_precision=no
    assert "DDP" not in plan.arithmetic["head"]


@pytest.mark.parametrize("overrides, message", [
    (["target=someone/unknown-model"], "not a local directory and not one of the known Hub shapes"),
    (["head.kind=medusa", "head.draft_vocab_size=null", "head.aux_layer_ids=null", "head.ttt_steps=null"],
     "activation estimates exist for head.kind=eagle3 only"),
    (["data.max_length=1000000"],  # training refuses it when it loads the target; so does the plan
     "data.max_length=1000000 exceeds the target's max_position_embeddings=131072"),
])
def test_the_script_refuses_in_one_line(overrides, message, capsys):
    """In-process, through the script's own ``run(main)`` (what its ``__main__`` exits with): a subprocess
    each cost ~15 s of imports; the script as a process is test_the_script_prints_the_70b_plan's."""
    from draftsmith.data.entry_point import run
    from draftsmith.scripts.cost import main

    code = run(main, ["--config", str(CONFIG_70B), "--gpus", "8", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_script_prints_the_70b_plan():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "cost.py"), "--config", str(CONFIG_70B), "--gpus",
                          "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "per-GPU memory" in run.stdout and "/ 8 shards" in run.stdout and "fits" in run.stdout


def test_a_demo_target_is_planned_only_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))  # an empty cache: nothing is built or fetched
    with pytest.raises(ValueError, match="target demo:tiny: not in the cache yet"):
        target_config("demo:tiny")
    with pytest.raises(ValueError, match="cost.py downloads nothing"):
        target_config("demo:smollm2")
    assert not any(tmp_path.iterdir())
