"""Values checked where they enter (constructors, CLI and config parsing): one-line errors naming the
value, never a silent default. ``0`` means 0: a count below its least value is refused, not replaced."""
from __future__ import annotations

import argparse
import math
import numbers


def count(name: str, value: object, least: int = 1) -> int:
    """``value`` as an int >= ``least``; a float, bool or string is refused (2.5 drafts is no count)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return int(value)


def probability(name: str, value: object, *, allow_none: bool = True) -> float | None:
    """``value`` as a float in (0, 1] (None passes when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"{name} must lie in (0, 1], got {value}")
    return float(value)


def cli_count(least: int = 1):
    """An argparse ``type``: a whole number >= ``least`` (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            return count("the value", int(text), least)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number >= {least} expected, got {text!r}") from None
    parse.__name__ = f"count >= {least}"
    return parse


def cli_counts(least: int = 1):
    """An argparse ``type``: comma-separated whole numbers, each >= ``least`` (e.g. ``1,4,16``)."""
    one = cli_count(least)

    def parse(text: str) -> list[int]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"comma-separated whole numbers >= {least} expected, got {text!r}")
        try:
            return [one(item) for item in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"comma-separated whole numbers >= {least} expected, got {text!r}") from None
    parse.__name__ = f"counts >= {least}"
    return parse


def cli_real(least: float = 0.0, most: float = math.inf, *, above: bool = False):
    """An argparse ``type``: a finite number in [``least``, ``most``], or in (``least``, ``most``] with
    ``above`` (a timeout of 0 seconds or a top-p of 0 is no value)."""
    low = f"> {least:g}" if above else f">= {least:g}"
    wanted = f"a number {low}" + (f" and <= {most:g}" if most != math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{wanted} expected, got {text!r}") from None
        if not math.isfinite(value) or (value <= least if above else value < least) or value > most:
            raise argparse.ArgumentTypeError(f"{wanted} expected, got {text!r}")
        return value
    parse.__name__ = wanted
    return parse
