"""Train a draft head: ``accelerate launch train/train_head.py [--config FILE] [key=value ...]``.

Without ``--config`` it uses ``configs/demo.yaml``: an EAGLE-3 head on the offline demo target
(built first if missing), minutes on CPU. ``--help`` lists every key. Nothing runs at import.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"


def cli(argv: list[str] | None = None) -> int:
    """Train; a mistake in the config or its inputs prints one line and returns 2, a divergence returns 1."""
    from draftsmith.data.entry_point import USER_ERRORS, one_line, quiet_libraries
    from draftsmith.train.args import parse_args  # before torch loads: a mistake is one line in a second
    from draftsmith.train.config import ConfigError

    quiet_libraries()
    try:
        cfg = parse_args(argv, default_config=DEMO_CONFIG)
    except ConfigError as err:
        return _fail(f"config error: {one_line(err)}", 2)
    from draftsmith.train.divergence import TrainingDiverged
    from draftsmith.train.metrics import format_acceptance
    from draftsmith.train.resume import RunComplete
    from draftsmith.train.run import setup
    try:
        result = setup(cfg)
    except RunComplete as err:  # resume_from=latest on a finished run: say so, train and save nothing
        print(one_line(err), flush=True)
        return 0
    except TrainingDiverged as err:  # before USER_ERRORS: it is a FloatingPointError, not a ValueError
        return _fail(f"error: {one_line(err)}", 1)
    except USER_ERRORS as err:
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        return _fail(f"error: {one_line(err)}", 2)
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"\n{cfg.head.kind} head saved to {result.output_dir.resolve()}")
        if result.metrics:
            print(format_acceptance(result.metrics))
        if result.best_dir is not None:
            by = result.metrics.get("best_by", "tau")
            by = "simulated" if by == "tau" else f"decode (T = {by[12:] or 0})"  # decode_tau, decode_tau_t<T>
            print(f"best {by} tau {result.best_tau:.3f} (head in {result.best_dir.resolve()})")
    return 0


def _fail(message: str, code: int) -> int:
    print(message, file=sys.stderr, flush=True)
    _end_launcher_quietly()
    return code


def _end_launcher_quietly() -> None:
    """Under ``accelerate launch`` (one process) a non-zero exit makes the launcher raise its own
    ``CalledProcessError`` traceback below our one-line message. The launcher only waits for this
    process, so end it first with SIGTERM (exit status 143, no traceback); nothing else is running.
    Linux only (reads /proc); multi-process launches are left alone, and so is ``draftsmith launch``
    (``scripts/launch.py``), which ends with this process's own exit code."""
    from draftsmith.train.launcher import launched_by_accelerate, parent_cmdline

    if os.environ.get("LOCAL_RANK") is not None or not launched_by_accelerate():
        return
    if os.environ.get("DRAFTSMITH_OWN_LAUNCH"):  # scripts/launch.py reads this process's exit code itself
        return
    parent = parent_cmdline()
    if parent and any(part.endswith(b"accelerate") for part in parent) and b"launch" in parent:
        sys.stdout.flush()
        os.kill(os.getppid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(cli())
