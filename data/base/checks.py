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


def flag(name: str, value: object) -> bool:
    """``value`` as a bool: True or False only (the string "no" is truthy, 0 and 1 are counts)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


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


def cli_choices(choices: tuple[str, ...]):
    """An argparse ``type``: comma-separated names, at least one, each of ``choices`` (e.g. ``eagle3,medusa``)."""
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items or any(item not in choices for item in items):
            raise argparse.ArgumentTypeError(f"comma-separated names of {', '.join(choices)} expected, got {text!r}")
        return items
    parse.__name__ = "names"
    return parse


def cli_temperatures(text: str) -> list[float]:
    """An argparse ``type``: comma-separated sampling temperatures, each a finite number >= 0 (0 = greedy), none
    twice (e.g. ``0,0.7,1``); a bad one is named in the one-line error."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"comma-separated temperatures >= 0 expected (0 = greedy), got {text!r}")
    values = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise argparse.ArgumentTypeError(f"{item!r} is no temperature (a number >= 0; 0 = greedy) in {text!r}")
        if value in values:
            raise argparse.ArgumentTypeError(f"{item!r} is listed twice in {text!r}")
        values.append(value)
    return values


cli_temperatures.__name__ = "temperatures"


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


# ---------------------------------------------------------------- numbers a file carries, used as indices
# A file's number that indexes a model (a vocabulary map, layer ids, a mask token, a block size, stored
# rows and shapes, a plan's batch sizes) is checked against that model when the file is loaded: one
# line naming the file, the field and the allowed range, never an out-of-range gather later.

def _source(where: object) -> str:
    return f"{where}: " if where else ""


def index(field: str, value: object, size: int, where: object = "", of: str = "") -> int:
    """``value`` as an int in [0, ``size``) (``of`` names what it indexes, e.g. "the target's 6 layers")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < size:
        of = f" ({of})" if of else ""
        raise ValueError(f"{_source(where)}{field}={value!r} is outside [0, {size - 1}]{of}")
    return int(value)


def indices(field: str, values: object, size: int, where: object = "", of: str = "") -> list[int]:
    """Every entry of ``values`` (a list or a 1-D tensor) in [0, ``size``); the first bad one is named."""
    items = values.tolist() if hasattr(values, "tolist") else values
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{_source(where)}{field} must be a list of whole numbers, got {type(values).__name__}")
    for i, value in enumerate(items):
        index(f"{field}[{i}]", value, size, where, of)
    return [int(v) for v in items]


def at_most(field: str, value: object, most: int | None, where: object = "", of: str = "") -> int:
    """``value`` as an int in [1, ``most``] (None: no upper bound); ``of`` names the bound."""
    count(f"{_source(where)}{field}", value)
    if most is not None and value > most:
        raise ValueError(f"{_source(where)}{field}={value} exceeds {of or 'its bound'}={most}")
    return int(value)
