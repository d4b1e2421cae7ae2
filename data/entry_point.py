"""Entry-point plumbing shared by ``scripts/*.py`` and the CLIs: user mistakes end in one line.

A missing file, a bad argument, a refused export or an unreachable Hub prints ``error: <message>``
on stderr and exits with code 2, without a traceback; ``DRAFTSMITH_DEBUG=1`` re-raises instead, for
bug reports. Anything else (a bug) keeps its traceback.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

USAGE_ERROR = 2
# What a user's input can cause: bad values, missing or existing files, Hub/network failures.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (multi-line messages joined with '; ')."""
    text = str(err).strip() or type(err).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def quiet_libraries() -> None:
    """No per-file progress bars from transformers, huggingface_hub and datasets ("Loading weights",
    "Writing model shards", "Map"): between log lines they are noise; draftsmith's own bars stay.
    Libraries not loaded yet read it from the environment when they load (transformers' bars follow
    huggingface_hub's switch): nothing heavy is imported here, so arguments are checked first."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def prog(default: str) -> str:
    """An entry point's name for argparse's usage and error lines: ``draftsmith COMMAND`` when run
    through the ``draftsmith`` command (which sets ``sys.argv[0]``), else ``default``."""
    return sys.argv[0] if sys.argv and sys.argv[0].startswith("draftsmith ") else default


def run(main: Callable[..., Any], argv: list[str] | None = None, *,
        errors: tuple[type[BaseException], ...] = USER_ERRORS) -> int:
    """Call ``main(argv)``; a user error prints one line and returns 2, else main's int result or 0."""
    quiet_libraries()
    try:
        result = main(argv)
    except errors as err:
        if os.environ.get("DRAFTSMITH_DEBUG"):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return USAGE_ERROR
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
