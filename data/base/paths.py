"""Where draftsmith caches things, files other users can read, and file digests."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX (Windows): caches are made without the cross-process lock
    fcntl = None


def cache_root() -> Path:
    """draftsmith's cache root: ``$DRAFTSMITH_CACHE`` if set, else ``~/.cache/draftsmith``.

    Below it: ``data/`` tokenized examples, ``draft_vocab/``, ``demo/`` demo LMs, ``assets/`` wheels."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith")


def keyed_cache_file(folder: str, key: dict) -> Path:
    """``<cache root>/<folder>/<model name>-<hash of key>.json``: one file per measurement's key (a JSON-able dict
    naming what the measurement depends on; its ``name_or_path`` names the file), so a measurement under another
    key (another target, device, dtype, thread count) is another file and is measured again."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(str(key.get("name_or_path") or "target")).name)
    return cache_root() / folder / f"{name}-{digest}.json"


@contextlib.contextmanager
def cache_lock(lock_file: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (created if missing) for the ``with`` block: another process
    making the same cache entry (a second job, a test on another pytest worker) waits here, then finds it
    made. POSIX ``flock``: released when the process dies, so a killed build never blocks the next one."""
    with open(lock_file, "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


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


REPORT_MARKER = ".draftsmith-report"  # written first into every report folder (benchmarks, GPU report)


def claim_report_dir(out: str | os.PathLike, option: str = "--out") -> Path:
    """Make ``out`` a folder a report may write into and return it: absent or empty (then marked as
    ours), or ours already (``REPORT_MARKER``; folders from before the marker by a results.json that
    holds benchmark ``rows``). A file or a folder of someone else's files is refused by name (and by the
    ``option`` that gave it): a report rewrites results.json, results.md and plots, and must not replace files
    it did not write."""
    out = check_report_dir(out, option)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_MARKER).write_text("a draftsmith report: its results.json, results.md and plots are rewritten\n")
    return out


def check_report_dir(out: str | os.PathLike, option: str = "--out") -> Path:
    """``out`` if ``claim_report_dir`` would take it (nothing made yet), else FileExistsError naming ``option``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{option} {out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not _is_report_dir(out):
        names = sorted(p.name for p in out.iterdir())
        raise FileExistsError(f"{option} {out} holds files no draftsmith report wrote ({', '.join(names[:5])}"
                              f"{', ...' if len(names) > 5 else ''}); name a new or empty folder")
    return out


def claim_report_file(out: str | os.PathLike, ours: Callable[[Path], bool], what: str) -> Path:
    """``out`` as a file a report may be written to: absent, or a ``what`` draftsmith wrote (``ours``
    reads it). A folder, or an existing file of someone else's, is refused by name, never replaced."""
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a folder; name a file for the {what}")
    if out.exists() and not ours(out):
        raise FileExistsError(f"--out {out} exists and is not a {what} draftsmith wrote; name a new file "
                              "(a file draftsmith did not write is never replaced)")
    return out


def json_with_keys(*keys: str) -> Callable[[Path], bool]:
    """A test for ``claim_report_file``: the file is a JSON object holding every one of ``keys``."""
    def test(path: Path) -> bool:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and all(key in record for key in keys)
    return test


def _is_report_dir(out: Path) -> bool:
    if (out / REPORT_MARKER).is_file():
        return True
    try:
        return isinstance(json.loads((out / "results.json").read_text()).get("rows"), list)
    except (OSError, ValueError, AttributeError):
        return False


def file_digest(path: str | os.PathLike) -> dict:
    """``{"bytes", "sha256"}`` of a file, read in 1 MiB blocks (checkpoint and feature manifests)."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def folder_digests(folder: str | os.PathLike, skip: tuple[str, ...] = ()) -> dict[str, dict]:
    """``{relative path: file_digest}`` of every file under ``folder`` but those named in ``skip``: the record
    a cache entry is checked against when it is used."""
    folder = Path(folder)
    return {f.relative_to(folder).as_posix(): file_digest(f) for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name not in skip}


def changed_files(folder: str | os.PathLike, recorded: dict[str, dict]) -> list[str]:
    """The files of ``recorded`` (``folder_digests``) missing under ``folder`` or differing from it."""
    folder = Path(folder)
    changed = []
    for name, expected in recorded.items():
        f = folder / name
        if not f.is_file() or f.stat().st_size != expected.get("bytes") or file_digest(f) != expected:
            changed.append(name)
    return changed

