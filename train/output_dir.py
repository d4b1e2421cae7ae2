"""Where a training run writes: only into an output_dir that is absent, empty or ours (issue 22).

Ours means marked by ``RUN_MARKER``, written first into every run's output_dir (runs from before the
marker are recognised by their metrics.jsonl or a complete checkpoint). ``overwrite_output_dir=true``
replaces only such a folder; a file, someone's own files, or a target model are refused whatever
the options, before anything is written. One run at a time: the run holds an exclusive lock on
``RUN_LOCK`` in its output_dir for its life (``hold_output_dir``); a second run into the same folder is
refused in one line naming the folder and the holder's pid, instead of both writing into it.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX (Windows): runs are not locked
    fcntl = None

from draftsmith.data.base.names import is_head_model_type
from draftsmith.train.checkpoint import BEST, CHECKPOINTS, METRICS_FILE, RUN_MARKER
from draftsmith.train.config import ConfigError, TrainConfig
from draftsmith.train.resume import check_not_complete, latest_checkpoint

RUN_LOCK = ".draftsmith-lock"  # flock-ed by the run writing into the folder; holds its pid and host


def is_our_run(output_dir: Path) -> bool:
    """Whether ``output_dir`` was written by a draftsmith training run: our marker (written first), or
    for runs from before it, a metrics.jsonl or a complete checkpoint."""
    return ((output_dir / RUN_MARKER).is_file() or (output_dir / METRICS_FILE).is_file()
            or latest_checkpoint(output_dir) is not None)


def check_output_dir(cfg: TrainConfig) -> None:
    """Write only into an output_dir that is absent, empty or ours; a fresh run (no ``resume_from``)
    must not replace an earlier run's results unless asked to (``overwrite_output_dir=true``).

    A file, a folder holding someone else's files (a README.md, a config.yaml) or a model that is
    not a draftsmith head (a target's config.json) is refused whatever the options: overwriting
    would delete or change files that draftsmith did not create.
    """
    output_dir = Path(cfg.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir={output_dir} is a file, not a directory; choose another output_dir")
    if not output_dir.is_dir() or not _entries(output_dir):
        return
    config = output_dir / "config.json"
    model_type = _model_type(config) if config.is_file() else None
    if not is_our_run(output_dir) or (config.is_file() and not is_head_model_type(model_type)):
        names = sorted(p.name for p in _entries(output_dir))
        what = (f"a model that is not a draftsmith head (config.json model_type={model_type})"
                if config.is_file() and not is_head_model_type(model_type) else
                f"files that no draftsmith run wrote ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})")
        raise ConfigError(f"output_dir={output_dir} holds {what}; draftsmith never writes into it, not even with "
                          "overwrite_output_dir=true or resume_from: choose a new or empty output_dir")
    check_not_complete(cfg, output_dir)
    if cfg.resume_from is not None or cfg.overwrite_output_dir:
        return
    earlier = [name for name in (CHECKPOINTS, BEST, METRICS_FILE, "model.safetensors") if (output_dir / name).exists()]
    if earlier:
        steps = latest_checkpoint(output_dir)
        where = f" (latest checkpoint {steps.name})" if steps else ""
        raise ConfigError(f"output_dir={output_dir} holds an earlier run ({', '.join(earlier)}){where}: pass "
                          "resume_from=latest to continue it, overwrite_output_dir=true to replace it, or choose "
                          "another output_dir")


@contextlib.contextmanager
def hold_output_dir(cfg: TrainConfig, main_process: bool = True) -> Iterator[None]:
    """Hold ``output_dir``'s run lock for the ``with`` block (the main process; the others write through it):
    another run holding it is refused (ConfigError naming the folder and its pid); under the lock the folder
    is checked again (``check_output_dir``: a run that ended in between may have filled it). POSIX ``flock``:
    released when the process dies, so a killed run never blocks the next one."""
    if not main_process or fcntl is None:
        yield
        return
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(output_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "pid unknown"
            raise ConfigError(f"output_dir={output_dir} is in use by another training run ({holder} holds "
                              f"{output_dir / RUN_LOCK}); wait for it to end or choose another output_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        check_output_dir(cfg)
        yield
    finally:
        os.close(fd)  # releases the lock


def _entries(output_dir: Path) -> list[Path]:
    """The folder's entries but the run lock (a crashed run's lock file alone leaves the folder empty)."""
    return [p for p in output_dir.iterdir() if p.name != RUN_LOCK]


def _model_type(config: Path) -> object:
    try:
        return json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError, OSError):
        return None
