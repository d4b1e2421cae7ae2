"""Model cards and exports never carry a path of this machine: a Hub id, the demo's name, or nothing."""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.data.base.paths import cache_root
from draftsmith.heads import build_head
from draftsmith.heads.card import model_card
from draftsmith.data.base.names import public_target_name
from draftsmith.heads.formats import export_head
from draftsmith.train.run import setup

SNAPSHOT = "/root/.cache/huggingface/hub/models--org--tiny-llama/snapshots/0123abcd"


@pytest.mark.parametrize("name, public", [
    ("org/tiny-llama", "org/tiny-llama"),
    ("demo:tiny", "demo:tiny"),
    (SNAPSHOT, "org/tiny-llama"),
    (str(cache_root() / "demo" / "tiny-seed0-0123456789ab"), "demo:tiny"),
    ("/home/someone/models/my-llama", None),
    ("", None),
])
def test_public_target_name(name, public):
    assert public_target_name(name) == public


def _head(name):
    target = make_tiny_target("llama", num_layers=8)
    target.config._name_or_path = name
    torch.manual_seed(0)
    return build_head("eagle3", target), target


def test_cards_and_exports_name_a_hub_id_not_a_cache_path(tmp_path):
    head, target = _head(SNAPSHOT)
    card = model_card(head)
    assert "base_model: org/tiny-llama" in card and "/root" not in card
    for fmt in ("vllm", "speculators"):
        out = export_head(head, tmp_path / fmt, fmt, target=target)
        text = (out / "config.json").read_text() + (out / "README.md").read_text()
        assert "/root" not in text and "org/tiny-llama" in text


def test_a_local_target_is_not_written_anywhere(tmp_path):
    head, target = _head("/home/someone/models/my-llama")
    assert "/home/someone" not in model_card(head) and "base_model" not in model_card(head).split("---")[1]
    out = export_head(head, tmp_path / "vllm", "vllm", target=target)
    assert "/home/someone" not in (out / "config.json").read_text() + (out / "README.md").read_text()
    with pytest.raises(ValueError, match="Hub id"):
        export_head(head, tmp_path / "spec", "speculators", target=target)


def test_a_training_run_card_holds_no_local_path(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "head.kind=medusa", "train.max_steps=2", "train.warmup_steps=0",
                      "train.eval_every=2"))
    card = (out / "README.md").read_text()
    assert str(tmp_path) not in card and "cache miss" not in card and "cache hit" not in card
    assert json.loads((out / "config.json").read_text())["target_name_or_path"]  # the head still knows it


def test_engine_commands_never_name_a_demo_target():
    head, _ = _head("x")
    head.config.target_name_or_path = "demo:tiny"
    card = model_card(head)
    assert "from_pretrained('demo:tiny'" in card  # draftsmith loads demo names
    assert "vllm serve TARGET_DIR" in card and "--model-path TARGET_DIR" in card  # engines load a directory
    assert "vllm serve demo:" not in card and "resolve_target('demo:tiny')" in card


@pytest.mark.parametrize("fmt", [None, *__import__("draftsmith.heads.formats", fromlist=["FORMATS"]).FORMATS])
def test_no_export_readme_tells_an_engine_to_load_a_demo_name(fmt):
    """The README of every export format, for every kind it takes: engines load a directory, never demo:<size>."""
    from draftsmith.heads.formats import FORMATS

    target = make_tiny_target("llama", num_layers=8)
    kinds = FORMATS[fmt].kinds if fmt is not None else ("eagle3", "eagle", "medusa", "dflash")
    for kind in kinds:
        head = build_head(kind, target)
        head.config.target_name_or_path = "demo:tiny"
        card = model_card(head, fmt=fmt)
        commands = [line for line in card.splitlines()
                    if any(word in line for word in ("serve", "--model-path", "launch_server", "trtllm", "--model-id"))]
        assert commands, f"{kind} {fmt}: no engine command in the card"
        assert not [line for line in commands if "demo:" in line], (kind, fmt)
