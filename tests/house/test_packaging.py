"""The package as users install it: a wheel built from this tree, installed into a fresh virtual environment,
run from a folder that is not a clone, trains the demo head and decodes with it; it installs one top-level
package, ``draftsmith``, and nothing named ``data``, ``train``, ``infer``, ``heads`` or ``scripts``."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from support.house import LAYERS as FOLDERS, REPO as ROOT


def listed_packages() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_code_folder_is_a_listed_package_and_the_data_folders_ship():
    """pyproject lists the packages by hand (the root maps to ``draftsmith``): a new subfolder with code must be
    listed or the wheel silently leaves it out."""
    code = {"draftsmith", *("draftsmith." + ".".join(p.parent.relative_to(ROOT).parts)
                            for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py"))}
    listed = listed_packages()
    assert code <= listed, f"folders with code missing from pyproject's packages: {sorted(code - listed)}"
    data_only = listed - code
    assert data_only == {"draftsmith.configs", "draftsmith.configs.accelerate", "draftsmith.data.demo_targets"}
    assert all((ROOT / Path(*name.split(".")[1:])).is_dir() for name in data_only)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=300)
    (found,) = out.glob("draftsmith-*.whl")
    return found


def test_the_wheel_holds_one_top_level_package_with_what_the_defaults_read(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"draftsmith", f"{wheel.name.split('-py3')[0]}.dist-info"}
    for needed in ("draftsmith/configs/demo.yaml", "draftsmith/train/train_head.py",
                   "draftsmith/data/demo_targets/tiny-seed0/model.safetensors"):
        assert needed in names, needed
    assert not any(n.startswith("draftsmith/tests/") or n.startswith("draftsmith/docs/") for n in names)


@pytest.mark.slow
def test_a_wheel_install_trains_the_demo_head_and_decodes_with_it_outside_the_clone(wheel, tmp_path):
    """The main job from a wheel, as a new user runs it: ``draftsmith train`` (configs/demo.yaml from the package,
    the demo target copied from the wheel into an empty cache), then ``draftsmith generate --compare``. The venv
    sees this machine's torch and libraries (``--system-site-packages``, installing the wheel ``--no-deps``):
    what is tested is our wheel, found before the editable install of the clone."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DRAFTSMITH_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1", WANDB_MODE="offline")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(env_dir / "bin" / "draftsmith"), *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=900)

    where = subprocess.run([str(python), "-c", "import draftsmith; print(draftsmith.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(env_dir), where
    for bare in FOLDERS:
        probe = subprocess.run([str(python), "-c", f"import {bare}"], cwd=work, env=env, capture_output=True, text=True)
        assert probe.returncode == 1 and f"No module named '{bare}'" in probe.stderr, (bare, probe.stderr)

    train = run("train", "train.max_steps=2", "train.warmup_steps=0", "train.eval_every=0", "data.eval_rows=4",
                "train.eval_decode_rows=2", "train.eval_decode_tokens=8",  # decode tau at the end, on a tiny share
                "data.self_distill.rows=8", "data.self_distill.max_new_tokens=32", "data.max_length=64",
                "output_dir=runs/head")
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-4000:]
    assert (work / "runs" / "head" / "config.json").is_file()
    decode = run("generate", "--head", "runs/head", "--prompt", "class Queue:", "--max-new-tokens", "16", "--compare",
                 "--rounds", "1")
    assert decode.returncode == 0, decode.stdout[-2000:] + decode.stderr[-4000:]
    assert decode.stdout.strip(), "no continuation printed"
    assert "outputs identical: yes" in decode.stderr, decode.stderr[-4000:]


# Libraries a training or decoding environment commonly holds (beside what is installed here).
COMMON_TOP_LEVEL = {"evaluate", "datasets", "transformers", "accelerate", "torch", "peft", "wandb", "tokenizers",
                    "safetensors", "numpy", "yaml", "tqdm", "deepspeed", "vllm", "sglang", "trl", "speculators"}


def test_no_file_run_as_a_script_shadows_a_library():
    """``accelerate launch train/train_head.py`` and ``python scripts/X.py`` put the script's folder first on
    sys.path, where a sibling named like a library (a ``train/evaluate.py`` beside HF's ``evaluate``) would be
    what ``import evaluate`` finds in any library we load: no name in those folders is a library's."""
    import pkgutil

    installed = {m.name for m in pkgutil.iter_modules([p for p in sys.path if p and Path(p).resolve() != ROOT])}
    for folder in ("train", "scripts", "infer"):
        names = {p.stem for p in (ROOT / folder).glob("*.py")} - {"__init__"}
        assert not names & (installed | COMMON_TOP_LEVEL), f"{folder}/ shadows {sorted(names & (installed | COMMON_TOP_LEVEL))}"
