"""Helpers moved out of tests/heads/test_hub.py (other test files share them; no tests here)."""
from __future__ import annotations

from pathlib import Path

import huggingface_hub


def install_in_offline_cache(monkeypatch, cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """Lay the uploaded files out as huggingface_hub's cache does, and go offline."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the environment once, at import: set what it derived too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
