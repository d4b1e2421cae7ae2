"""Where draftsmith caches things, files other users can read, and file digests."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """draftsmith's cache root: ``$DRAFTSMITH_CACHE`` if set, else ``~/.cache/draftsmith``.

    Below it: ``data/`` tokenized examples, ``draft_vocab/``, ``demo/`` demo LMs, ``assets/`` wheels."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith")


def share_readable(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the permissions a plain ``open`` and
    ``mkdir`` would: 0644/0755 under umask 022. safetensors' ``save_file`` writes 0600 and
    ``tempfile.mkdtemp`` 0700, which a server running as another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    root = Path(path)
    for item in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if item.is_symlink():
            continue
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)


def file_digest(path: str | os.PathLike) -> dict:
    """``{"bytes", "sha256"}`` of a file, read in 1 MiB blocks (checkpoint and feature manifests)."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
