"""The package as users install it: a wheel built from this tree, installed into a fresh virtual environment,
run from a folder that is not a clone, trains the demo head and decodes with it; it installs one top-level
package, ``draftsmith``, and nothing named ``data``, ``train``, ``infer``, ``heads`` or ``scripts``; our own
measurement harnesses (``lab/``) stay in the clone."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from support.house import INSTALLED, LAYERS as FOLDERS, REPO as ROOT


def listed_packages() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_code_folder_is_a_listed_package_and_the_data_folders_ship():
    """pyproject lists the packages by hand (the root maps to ``draftsmith``): a new subfolder with code must be
    listed or the wheel silently leaves it out."""
    code = {"draftsmith", *("draftsmith." + ".".join(p.parent.relative_to(ROOT).parts)
                            for folder in INSTALLED for p in (ROOT / folder).rglob("__init__.py"))}
    listed = listed_packages()
    assert not any(name == "draftsmith.lab" or name.startswith("draftsmith.lab.") for name in listed), \
        "lab/ (our own harnesses) must not be installed"
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
    assert not any(n.startswith(("draftsmith/tests/", "draftsmith/docs/", "draftsmith/lab/")) for n in names)


def test_no_installed_command_names_a_lease(wheel):
    """The wheel's ``draftsmith`` commands and their one-line descriptions: none is our GPU lease harness
    (``lab/``), and no help text in the installed scripts names a lease budget."""
    from draftsmith.scripts.commands import COMMANDS, usage

    assert not [n for n in COMMANDS if "lease" in n or "gpu-report" in n]
    assert not re.search(r"\blease", usage(), re.IGNORECASE)
    texts = {n: zipfile.ZipFile(wheel).read(n).decode() for n in zipfile.ZipFile(wheel).namelist()
             if n.startswith("draftsmith/scripts/") and n.endswith(".py")}
    assert texts and not [n for n, text in texts.items() if re.search(r"\blease", text, re.IGNORECASE)], "installed scripts naming a lease"


# Libraries a training or decoding environment commonly holds (beside what is installed here).
COMMON_TOP_LEVEL = {"evaluate", "datasets", "transformers", "accelerate", "torch", "peft", "wandb", "tokenizers",
                    "safetensors", "numpy", "yaml", "tqdm", "deepspeed", "vllm", "sglang", "trl", "speculators"}


def test_no_file_run_as_a_script_shadows_a_library():
    """``accelerate launch train/train_head.py`` and ``python scripts/X.py`` put the script's folder first on
    sys.path, where a sibling named like a library (a ``train/evaluate.py`` beside HF's ``evaluate``) would be
    what ``import evaluate`` finds in any library we load: no name in those folders is a library's."""
    import pkgutil

    installed = {m.name for m in pkgutil.iter_modules([p for p in sys.path if p and Path(p).resolve() != ROOT])}
    for folder in ("train", "scripts", "infer", "lab"):
        names = {p.stem for p in (ROOT / folder).glob("*.py")} - {"__init__"}
        assert not names & (installed | COMMON_TOP_LEVEL), f"{folder}/ shadows {sorted(names & (installed | COMMON_TOP_LEVEL))}"
