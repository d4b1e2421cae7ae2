"""User mistakes in scripts/*.py and the CLIs end in one line on stderr and exit code 2 (no traceback);
a target is resolved the same way everywhere (demo names, missing paths, an unreachable Hub)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from support.targets import make_tiny_target
from huggingface_hub import HfApi

import draftsmith.data.demo

from draftsmith import data
from draftsmith.data.targets import HubUnreachable, resolve_target
from draftsmith.heads import build_head
from support.house import REPO



def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}_cli", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_errors")
    target = make_tiny_target("llama", num_layers=8)
    target.config._name_or_path = "org/tiny-llama"
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    build_head("eagle3", target).save_pretrained(root / "head")
    (root / "no-config").mkdir()
    (root / "no-config" / "model.safetensors").write_bytes(b"")
    return root


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err  # the last line says what is wrong
    assert sum(line.startswith("error: ") for line in err) == 1 and not any("Traceback" in line for line in err)
    return err[-1]


@pytest.mark.parametrize("case, message", [
    ("format of another kind", "format 'medusa-tgi' exports medusa heads"),
    ("out not empty", "exists and is not empty"),
    ("head missing", "no such directory"),
    ("head without config", "no config.json"),
    ("target missing", "no such directory"),
])
def test_export_mistakes_are_one_line_and_exit_2(dirs, tmp_path, capsys, case, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    head, out, extra = str(dirs / "head"), str(tmp_path / "out"), []
    if case == "format of another kind":
        extra = ["--to", "medusa-tgi"]
    elif case == "out not empty":
        out = str(tmp_path / "full")
    elif case == "head missing":
        head = str(tmp_path / "nowhere" / "head")
    elif case == "head without config":
        head = str(dirs / "no-config")
    elif case == "target missing":
        extra = ["--target", str(tmp_path / "no" / "target")]
    argv = ["--head", head, "--out", out, *(extra if "--to" in extra else ["--to", "vllm", *extra])]
    assert _script("export").cli(argv) == 2
    assert message in _one_error_line(capsys)


def test_export_accepts_a_demo_target_name(dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data.demo, "demo_target_path", lambda name: str(dirs / "target"))
    out = tmp_path / "export"
    assert _script("export").cli(["--head", str(dirs / "head"), "--to", "vllm", "--out", str(out),
                                  "--target", "demo:tiny"]) == 0
    assert (out / "config.json").is_file()


def test_generator_accepts_a_demo_target_name(dirs, monkeypatch):
    from draftsmith.infer import SpeculativeGenerator

    calls = []
    monkeypatch.setattr(data.demo, "demo_target_path", lambda name: calls.append(name) or str(dirs / "target"))
    gen = SpeculativeGenerator.from_pretrained("demo:tiny", dirs / "head")
    assert calls == ["demo:tiny"] and gen.target.config.num_hidden_layers == 8


def test_push_without_network_names_the_repo(dirs, monkeypatch, capsys):
    import httpx

    def unreachable(self, *args, **kwargs):  # the Hub's server cannot be reached
        raise httpx.ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    assert _script("push_to_hub").cli(["--head", str(dirs / "head"), "--repo-id", "user/my-head"]) == 2
    line = _one_error_line(capsys)
    assert "user/my-head" in line and "the Hugging Face Hub is unreachable" in line
    assert "could not upload" in line and "nothing was pushed" in line and "local cache" not in line


def test_a_head_on_an_unreachable_hub_names_the_repo(dirs, tmp_path, monkeypatch, capsys):
    from transformers import PretrainedConfig

    def offline(*args, **kwargs):  # what transformers raises when the Hub does not answer
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.\nCheck your internet connection.")

    monkeypatch.setattr(PretrainedConfig, "get_config_dict", offline)
    assert _script("export").cli(["--head", "user/remote-head", "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert "user/remote-head" in line and "the Hugging Face Hub is unreachable" in line


def test_generate_cli_mistakes_are_one_line(dirs, tmp_path, capsys):
    from draftsmith.infer.generate_command import cli

    assert cli(["--head", str(tmp_path / "missing"), "--prompt", "w5"]) == 2
    assert "no such directory" in _one_error_line(capsys)
    assert cli(["--head", str(dirs / "head"), "--target", str(tmp_path / "t" / "x"), "--prompt", "w5"]) == 2
    assert "no such directory" in _one_error_line(capsys)


@pytest.mark.parametrize("target, message", [
    ("./nowhere/model", "no such directory"),
    ("/abs/nowhere", "no such directory"),
])
def test_resolve_target_names_a_missing_path(target, message):
    with pytest.raises(FileNotFoundError, match=message):
        resolve_target(target)
    assert resolve_target("org/model") == "org/model"  # a Hub id is left to from_pretrained


def test_hub_unreachable_is_an_oserror():
    assert issubclass(HubUnreachable, OSError)


def test_export_script_end_to_end_prints_one_line(dirs, tmp_path):
    """The real entry point: no traceback, exit code 2."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "export.py"), "--head", str(dirs / "head"),
                           "--to", "medusa-tgi", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_infer_does_not_import_train():
    """infer/ is importable without the training code: no `train` import anywhere in it."""
    import ast

    for path in sorted((REPO / "infer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n in ("train", "draftsmith.train") or n.startswith(("train.", "draftsmith.train.")) for n in names), f"{path.name} imports {names}"
    proc = subprocess.run([sys.executable, "-c", "import sys, draftsmith.infer, draftsmith.infer.generate_command; "
                           "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['draftsmith', 'train']))"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_a_relative_path_under_an_existing_folder_is_a_path(tmp_path, monkeypatch):
    """`runs/demo-tiny-eagle3` before training: a missing directory, not a Hub repo to look up."""
    from draftsmith.heads import AutoHead

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="runs/demo-tiny-eagle3: no such directory"):
        AutoHead.from_pretrained("runs/demo-tiny-eagle3")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        resolve_target("runs/some-model")
