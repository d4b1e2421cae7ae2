"""A training run writes only into an output_dir that is absent, empty or its own (issue 22, B):
someone's folder, a target's folder or a file is refused, even with overwrite_output_dir=true, and
nothing in it changes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.train.checkpoint import CHECKPOINTS, RUN_MARKER
from draftsmith.train.config import ConfigError
from draftsmith.train.run import setup

FAST = ["head.kind=medusa", "train.max_steps=2", "train.save_every=2", "train.eval_every=0", "data.eval=null",
        "train.warmup_steps=0"]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


USER_FILES = {
    "readme": {"README.md": "# my notes\n"},
    "config": {"config.yaml": "lr: 1\n", "config.json": json.dumps({"model_type": "llama"})},
    "mixed": {"README.md": "# mine\n", "config.json": json.dumps({"model_type": "llama"}), "config.yaml": "x: 1\n"},
}


@pytest.mark.parametrize("files", USER_FILES.values(), ids=USER_FILES.keys())
@pytest.mark.parametrize("options", [[], ["overwrite_output_dir=true"], ["resume_from=latest"]])
def test_a_folder_with_the_users_files_is_refused(tiny_files, tmp_path, files, options):
    out = tmp_path / "mine"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    before = snapshot(out)
    with pytest.raises(ConfigError, match=r"output_dir=.*mine holds .*never writes into it"):
        setup(tiny_config(tiny_files, out, *FAST, *options))
    assert snapshot(out) == before


def test_the_targets_folder_and_a_file_are_refused(tiny_files, tmp_path):
    target = Path(tiny_files["target"])
    before = snapshot(target)
    with pytest.raises(ConfigError, match="not a draftsmith head .*model_type="):
        setup(tiny_config(tiny_files, target, *FAST, "overwrite_output_dir=true"))
    assert snapshot(target) == before
    (tmp_path / "out").write_text("a file")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        setup(tiny_config(tiny_files, tmp_path / "out", *FAST, "overwrite_output_dir=true"))
    assert (tmp_path / "out").read_text() == "a file"


def test_a_run_marks_its_folder_and_overwrite_replaces_only_that(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *FAST))
    assert (out / RUN_MARKER).is_file() and (out / CHECKPOINTS).is_dir()
    again = setup(tiny_config(tiny_files, out, *FAST, "overwrite_output_dir=true"))
    assert again.steps == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert setup(tiny_config(tiny_files, empty, *FAST)).steps == 2  # an empty folder is fine
