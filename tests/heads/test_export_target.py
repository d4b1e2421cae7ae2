"""``export --to speculators`` of an EAGLE-3 head writes the target's embedding: without ``--target`` it takes
the head's own target (as ``generate`` does), and a head that records none is one line asking for it."""
from __future__ import annotations

import torch
from support.targets import make_tiny_target
from safetensors.torch import load_file

from draftsmith.data.entry_point import run
from draftsmith.heads import build_head
from draftsmith.scripts.export import main


def test_the_head_s_own_target_is_the_default(tmp_path, capsys):
    target = make_tiny_target("llama", num_layers=8)
    target.save_pretrained(tmp_path / "target")
    target.config._name_or_path = str(tmp_path / "target")
    head = build_head("eagle3", target)
    head.save_pretrained(tmp_path / "head")
    out = tmp_path / "out"
    assert run(main, ["--head", str(tmp_path / "head"), "--to", "speculators", "--out", str(out),
                      "--verifier", "org/target"]) == 0
    assert f"target: {tmp_path / 'target'} (the head's own" in capsys.readouterr().err
    assert torch.equal(load_file(out / "model.safetensors")["embed_tokens.weight"], target.get_input_embeddings().weight)


def test_a_head_recording_no_target_asks_for_one(tmp_path, capsys):
    head = build_head("eagle3", make_tiny_target("llama", num_layers=8))
    head.config.target_name_or_path = ""
    head.save_pretrained(tmp_path / "head")
    assert run(main, ["--head", str(tmp_path / "head"), "--to", "speculators", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "records no target (target_name_or_path)" in err and "pass --target" in err
    assert not (tmp_path / "out").exists()
