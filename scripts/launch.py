"""``accelerate launch train/train_head.py`` whose exit code is the training's own.

    draftsmith launch [ACCELERATE OPTIONS] [--config FILE] [key=value ...]
    draftsmith launch --num_processes 2 --multi_gpu --config configs/demo.yaml train.max_steps=50

accelerate's own launcher turns any failing training process into exit code 1 and a traceback of its
own (``CalledProcessError``, or torch elastic's ``ChildFailedError`` with several processes), so a
mistake in the config, which the training reports in one line with exit code 2 when run directly,
cannot keep that code under ``accelerate launch``. This command runs the same launcher in-process
(accelerate's ``launch_command``) and ends with the training processes' own exit code instead: 0,
2 for a user mistake (its one line printed by the processes), 1 for a divergence. Everything before
the first ``--config`` or ``key=value`` is an accelerate option (``accelerate launch --help``), the rest
goes to ``train/train_head.py``.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "train" / "train_head.py"
OWN_LAUNCH = "DRAFTSMITH_OWN_LAUNCH"  # tells the training processes that this launcher reads their code
_SETTING = re.compile(r"[A-Za-z_][\w.]*=")
COUNTS = ("num_processes", "num_machines", "num_cpu_threads_per_process")  # accelerate options that count


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(accelerate options, training arguments): the training's start at the first ``--config`` or
    ``key=value`` (an accelerate option's ``--name=value`` starts with a dash)."""
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config=") or _SETTING.match(arg):
            return argv[:i], argv[i:]
    return argv, []


def exit_code(err: BaseException) -> int:
    """The training processes' exit code behind a launcher's failure (the largest when they differ)."""
    if isinstance(err, subprocess.CalledProcessError):
        return err.returncode if err.returncode > 0 else 1
    failures = getattr(err, "failures", None)  # torch.distributed.elastic ChildFailedError: rank -> failure
    codes = [getattr(f, "exitcode", 1) for f in failures.values()] if isinstance(failures, dict) else []
    positive = [c for c in codes if isinstance(c, int) and c > 0]
    return max(positive) if positive else 1


def cli(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    options, training = split_args(argv)
    unknown = unknown_options(options)  # accelerate's parser loads torch first: tens of seconds on a busy machine
    if unknown:
        print(f"error: {unknown[0]} is not an option of accelerate launch (accelerate launch --help lists them; "
              "the training's settings follow --config or start with key=value)", file=sys.stderr)
        return 2
    code = _check_training_args(training)  # before accelerate loads torch: a config mistake is one line in a second
    if code is not None:
        return code
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    try:
        args = parser.parse_args([*options, str(TRAIN_SCRIPT), *training])
    except SystemExit as err:  # argparse already printed its one line
        return int(err.code or 0)
    for name in COUNTS:  # accelerate reads 0 processes as "not given" and trains with one
        value = getattr(args, name, None)
        if value is not None and value < 1:
            print(f"error: --{name} must be >= 1, got {value}", file=sys.stderr)
            return 2
    os.environ[OWN_LAUNCH] = "1"
    try:
        launch_command(args)
    except Exception as err:  # noqa: BLE001 - the launcher's wrapper of a failing process: its code instead
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        code = exit_code(err)
        if not isinstance(err, subprocess.CalledProcessError) and not hasattr(err, "failures"):
            print(f"error: accelerate launch failed: {type(err).__name__}: {err}", file=sys.stderr)
        return code
    return 0


def unknown_options(options: list[str]) -> list[str]:
    """The ``--names`` in ``options`` that accelerate launch's parser declares neither whole nor as a prefix
    (argparse's abbreviations), read from the installed accelerate's source: importing it loads torch."""
    names = accelerate_option_names()
    if not names:  # a layout this reader does not know: accelerate's parser decides, later
        return []
    given = [arg.split("=", 1)[0] for arg in options if arg.startswith("-") and not _number(arg)]
    return [arg for arg in given if not any(name.startswith(arg) for name in names)]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return text == "-"
    return True


def accelerate_option_names() -> set[str]:
    """Every option string of ``accelerate.commands.launch``'s ``add_argument`` calls (empty if not found)."""
    spec = importlib.util.find_spec("accelerate")  # a top-level spec: accelerate itself is not imported
    source = Path(next(iter(spec.submodule_search_locations or []), "")) / "commands" / "launch.py" if spec else None
    if source is None or not source.is_file():
        return set()
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return names


def _check_training_args(training: list[str]) -> int | None:
    """None when the training's ``[--config FILE] [key=value ...]`` parse, else the exit code (its one line,
    or --help, printed). accelerate's own options are checked by accelerate's parser, which loads torch first."""
    from draftsmith.data.entry_point import one_line
    from draftsmith.train.args import parse_args
    from draftsmith.train.config import ConfigError
    from draftsmith.train.train_head import DEMO_CONFIG

    try:
        parse_args(training, default_config=DEMO_CONFIG)
    except ConfigError as err:
        print(f"config error: {one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as err:  # argparse printed its one line (2) or the help (0)
        return int(err.code or 0)
    return None


if __name__ == "__main__":
    sys.exit(cli())
