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
    "Writing model shards", "Map"): between log lines they are noise; draftsmith's own bars stay."""
    import datasets
    import huggingface_hub
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    datasets.disable_progress_bars()


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
