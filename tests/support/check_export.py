"""Helpers moved out of tests/heads/test_check_export.py (other test files share them; no tests here)."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from draftsmith.heads.formats import export_head
from draftsmith.heads.formats.parity import speculators_python, venv_dir
from draftsmith.scripts.check_export import cli as check_cli


@functools.cache
def _venv_python(venv: Path) -> Path:
    """``speculators_python()`` of the venv at ``venv`` (``venv_dir()``, the cache key), probed once per session:
    its probe imports speculators in a fresh venv process (~10 s), and every library test asked it again
    (FileNotFoundError is not cached: a missing venv is asked again, and skips again)."""
    return speculators_python(create=False)


def library() -> Path:
    given = os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON")
    if given:
        return Path(given)
    try:
        return _venv_python(venv_dir())
    except FileNotFoundError as err:
        if os.environ.get("CI"):  # .ci/run builds the venv: a consumer check that cannot run there is a failure
            pytest.fail(f"CI without the speculators venv: {err}")
        pytest.skip(f"speculators 0.9.0 is not installed here ({err})")


def export(tmp_path, head, target, name="spec"):
    head_dir = tmp_path / f"{name}-head"
    head.save_pretrained(head_dir)
    out = export_head(head, tmp_path / name, "speculators", target=target, verifier=target.config._name_or_path)
    return out, head_dir


def check(out, head_dir, target, capsys):
    code = check_cli([str(out), "--head", str(head_dir), "--target", target.config._name_or_path,
                      "--python", str(library())])
    return code, capsys.readouterr().out


def check_export_plant(out, config_edit=None, tensor_edit=None):
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    if config_edit:
        config_edit(config)
    if tensor_edit:
        tensor_edit(tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
