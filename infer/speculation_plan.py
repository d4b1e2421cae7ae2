"""When to speculate: a per-batch-size draft length, measured once per target, head and machine.

Speculation pays when a verify over N tokens costs little more than one token's forward. As the
batch grows, each verify carries B x N tokens and drafting costs per row too, so past some batch
size plain decoding is faster (on a CPU already at a few rows; on an accelerator much later). A
``SpeculationPlan`` maps batch sizes to the draft length that measured fastest there, 0 meaning
"off" (the generator then decodes one token per row per step, without drafting). Written by
``scripts/speculation_plan.py`` as ``speculation_plan.json`` (into the head's directory by
default, where ``SpeculativeGenerator.from_pretrained`` finds it); a batch size between calibrated
ones takes the entry of the largest calibrated size below it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PLAN_FILE = "speculation_plan.json"


@dataclass(frozen=True)
class SpeculationPlan:
    """``lengths``: batch size -> draft levels per step (0 = don't speculate); ``measured``: what the
    calibration saw (kept for reading, never used to decide)."""

    lengths: dict[int, int]
    measured: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lengths:
            raise ValueError("a speculation plan needs at least one batch size")
        for batch, length in self.lengths.items():
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise ValueError(f"speculation plan: batch size {batch!r} must be an int >= 1")
            if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                raise ValueError(f"speculation plan: draft length {length!r} for batch size {batch} must be an int >= 0")

    def length_for(self, batch: int) -> int:
        """The draft length for ``batch`` rows: the entry of the largest calibrated batch size <= batch
        (the smallest calibrated size's below all of them)."""
        sizes = sorted(self.lengths)
        below = [s for s in sizes if s <= batch]
        return self.lengths[below[-1] if below else sizes[0]]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"lengths": {str(b): n for b, n in sorted(self.lengths.items())},
                                    "measured": self.measured}, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> SpeculationPlan:
        """Read a plan written by ``save``; a malformed file fails with a message naming it."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
            keys = list(raw["lengths"])
            lengths = {int(b): n for b, n in raw["lengths"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: not a speculation plan ({type(err).__name__}: {err}); expected "
                             '{"lengths": {"<batch size>": <draft length>, ...}}') from err
        if len(lengths) < len(keys):  # "1" and "01": the later entry won without a word
            twice = next(b for b in lengths if sum(int(k) == b for k in keys) > 1)
            raise ValueError(f"{path}: batch size {twice} is given more than once "
                             f"({', '.join(repr(k) for k in keys if int(k) == twice)}); keep one entry")
        try:
            return cls(lengths, list(raw.get("measured", [])))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from err


def _unique_keys(pairs: list) -> dict:
    """A JSON object as a dict, refusing a key given twice (``json`` keeps the last without a word)."""
    keys = [k for k, _ in pairs]
    twice = [k for k in dict.fromkeys(keys) if keys.count(k) > 1]
    if twice:
        raise ValueError(f"key {twice[0]!r} is given more than once")
    return dict(pairs)


def find_plan(head_dir: str | Path) -> SpeculationPlan | None:
    """The plan saved next to a head (``<head_dir>/speculation_plan.json``), or None."""
    path = Path(head_dir) / PLAN_FILE
    return SpeculationPlan.load(path) if path.is_file() else None


def choose_lengths(rows: list[dict]) -> dict[int, int]:
    """Per batch size, the draft length with the most tokens/s among measured ``rows``
    ({"batch_size", "length", "tokens_per_s"}); ties go to the shorter draft."""
    best: dict[int, tuple[float, int]] = {}
    for row in rows:
        b, n, speed = row["batch_size"], row["length"], row["tokens_per_s"]
        if b not in best or speed > best[b][0] or (speed == best[b][0] and n < best[b][1]):
            best[b] = (speed, n)
    return {b: n for b, (_, n) in sorted(best.items())}
