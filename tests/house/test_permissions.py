"""What draftsmith writes is readable by other users as save_pretrained users expect: files 0644 and
folders 0755 under the usual umask 022 (safetensors' save_file alone writes 0600, mkdtemp 0700)."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from support.targets import make_tiny_target
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.heads import build_head
from draftsmith.heads.formats import export_head
from draftsmith.train.run import setup


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root):
    bad = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        want = 0o755 if path.is_dir() else 0o644
        if mode != want:
            bad.append(f"{path.relative_to(root)}: {oct(mode)}")
    return bad


def test_saved_heads_and_exports_are_world_readable(tmp_path, umask_022):
    target = make_tiny_target("llama", num_layers=8)
    target.config._name_or_path = "org/tiny"
    torch.manual_seed(0)
    head = build_head("eagle3", target)
    head.save_pretrained(tmp_path / "head")
    assert _modes(tmp_path / "head") == []
    for fmt in ("vllm", "speculators"):
        assert _modes(export_head(head, tmp_path / fmt, fmt, target=target)) == []


def test_a_training_run_is_world_readable(tiny_files, tmp_path, umask_022):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "head.kind=medusa", "train.max_steps=2", "train.save_every=2",
                      "train.eval_every=2", "train.warmup_steps=0"))
    assert _modes(out) == []
