"""demo:tiny and demo:tiny-mtp ship built (data/demo_targets/SIZE-seed0): copied into the cache when it is the LM
asked for and every file is as recorded; a changed recipe or a damaged file is said in one line and built instead."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import draftsmith.data.demo as demo
from draftsmith.data.base.paths import changed_files
from draftsmith.data.demo_lm import SUMMARY_FILE, settings_for
from support.house import REPO

SHIPPED_TINY = demo.SHIPPED / "tiny-seed0"


def _record(folder: Path = SHIPPED_TINY) -> dict:
    return json.loads((folder / SUMMARY_FILE).read_text())


def _todays_fingerprint(size: str = "tiny") -> str:
    """The fingerprint ``data.demo`` computes now for demo:``size`` (seed 0, its tokenizer)."""
    return demo.demo_target_dir(size, 0).name.rsplit("-", 1)[1]


@pytest.mark.parametrize("size", ["tiny", "tiny-mtp"])
def test_the_shipped_copy_is_todays_demo_target(size, monkeypatch):
    """A recipe change (RECIPE_VERSION, a preset, the corpus rules) that forgets to refresh a shipped copy
    fails here: refresh with `draftsmith make-demo --size SIZE --ship`. The fingerprint is computed over the corpus
    fingerprint the copy records, so this holds on a Python whose standard library (the corpus) differs too (there
    the copy is built instead of used: test_a_shipped_copy_of_another_fingerprint_is_not_used)."""
    folder = demo.SHIPPED / f"{size}-seed0"
    record = _record(folder)
    assert changed_files(folder, record["files"]) == []  # a cut or LFS-pointer checkout fails here too
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(record["files"])
    assert settings_for(size, seed=0).cache_key().items() <= record["settings"].items()
    monkeypatch.setattr(demo, "corpus_fingerprint", lambda: record["corpus_fingerprint"])
    assert record["fingerprint"] == _todays_fingerprint(size)
    assert sorted(p.name for p in demo.SHIPPED.iterdir() if p.is_dir()) == ["tiny-mtp-seed0", "tiny-seed0"]


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A copy of the shipped folder recorded under today's fingerprint (so that the tests below do not depend
    on this Python's stdlib), the cache in tmp_path, and a builder that records its calls instead of
    training for minutes."""
    root = tmp_path / "shipped"
    shutil.copytree(SHIPPED_TINY, root / "tiny-seed0")
    record = _record(root / "tiny-seed0")
    record["fingerprint"] = _todays_fingerprint()
    (root / "tiny-seed0" / SUMMARY_FILE).write_text(json.dumps(record, indent=2) + "\n")
    monkeypatch.setattr(demo, "SHIPPED", root)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    builds = []

    def fake_train(out, settings, **kwargs):
        builds.append(settings)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / SUMMARY_FILE).write_text(json.dumps(kwargs["metadata"]))

    monkeypatch.setattr(demo, "train_lm", fake_train)
    return root / "tiny-seed0", builds


def test_the_shipped_copy_is_copied_not_built(shipped, capsys):
    folder, builds = shipped
    out = demo.ensure_demo_target("tiny")
    assert builds == []
    assert out == demo.demo_target_dir("tiny") and not list(out.parent.glob(".*tmp*"))
    for name in [*_record(folder)["files"], SUMMARY_FILE]:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "comes built with draftsmith" in err[0] and str(out) in err[0], err
    assert demo.ensure_demo_target("tiny") == out and capsys.readouterr().err == ""  # the cache from now on


def test_a_shipped_file_with_one_byte_changed_is_not_used(shipped, capsys):
    folder, builds = shipped
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 1  # same size, one bit: only the sha256 sees it
    (folder / "model.safetensors").write_bytes(bytes(weights))
    out = demo.ensure_demo_target("tiny")
    assert len(builds) == 1 and json.loads((out / "config.json").read_text()) == {}  # the builder's output
    err = capsys.readouterr().err
    assert f"the demo target shipped in {folder} is damaged (model.safetensors missing or changed" in err, err


def test_a_shipped_copy_of_another_fingerprint_is_not_used(shipped, capsys):
    folder, builds = shipped
    record = _record(folder)
    record["fingerprint"] = "0" * 12  # as if the recipe or the corpus changed since it was built
    (folder / SUMMARY_FILE).write_text(json.dumps(record))
    demo.ensure_demo_target("tiny")
    assert len(builds) == 1
    err = capsys.readouterr().err
    assert f"has fingerprint {'0' * 12}, this request {_todays_fingerprint()}" in err, err
    demo.ensure_demo_target("tiny", max_steps=3)  # another LM than the shipped one: built, and nothing to say
    assert len(builds) == 2 and "the demo target shipped in" not in capsys.readouterr().err


def test_ship_replaces_the_shipped_copy(shipped, tmp_path):
    import importlib.util

    folder, _ = shipped
    spec = importlib.util.spec_from_file_location(
        "make_demo_target", REPO / "scripts" / "make_demo_target.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    built = tmp_path / "built"
    shutil.copytree(folder, built)
    record = _record(built)
    (built / "generation_config.json").write_text('{"changed": true}\n')  # a rebuild that differs
    record["files"] = demo.folder_digests(built, skip=(SUMMARY_FILE,))
    record["fingerprint"] = "1" * 12
    (built / SUMMARY_FILE).write_text(json.dumps(record))
    assert script.ship(built, "tiny-seed0") == folder
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in built.iterdir())
    assert all((folder / p.name).read_bytes() == p.read_bytes() for p in built.iterdir())
    assert not list(folder.parent.glob(".*tmp*"))
