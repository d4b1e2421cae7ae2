"""What a decode step costs, in seconds, per draft length: measured once per target, drafter, device, dtype and
thread count, kept in the cache, read by the draft-length chooser (``infer.drafters.free.chooser``).

A ``StepCosts`` is one curve: for each profiled draft length k (0: plain decoding, the root alone), the seconds
of a step's drafting (the drafter's observe of the last accepted tokens and its proposal of k levels), of its
verify (one target forward over k + 1 tokens: t(N) at N = k + 1) and of the rest (accept, emit, compact, a
hybrid's rollback). Beside the curve, ``probe``: the seconds of a step drafting one level after ``PROBE_IDLE``
steps at 0, its drafter first observing every token it skipped (what the chooser's probe costs). A ``CostModel``
holds one curve per batch size and sampling mode (sampled drafts and their acceptance cost more than greedy ones),
under the key of what they depend on; ``infer.cost_profile`` measures and saves them. Stored as the speculation
plan is (``infer.speculation_plan``: JSON, a malformed file named), one file per key in the cache
(``data.base.paths.keyed_cache_file``, as a layer-skip calibration): a key that no longer matches (another thread
count, dtype, drafter) is another file, measured again.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.data.base.paths import keyed_cache_file

COSTS_DIR = "step-costs"  # under the cache root: one JSON per key
# of the measurement (2: the k interleaved over rounds; 3: drafting fitted per level; 5: medians again; 6: the probe,
# plain steps after their warm-up; 7: the EAGLE-3 head drafts without its modules, cheaper per level); a record of
# another version is measured again
VERSION = 7
PROBE_IDLE = 32  # steps at 0 before the one-level step ``StepCosts.probe`` times


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step at the profiled draft ``lengths`` (ascending, starting at 0): ``draft``, ``verify`` and
    ``other`` for each. Between profiled lengths the seconds are interpolated; each phase is made non-decreasing
    in k (``rising``: a longer draft never costs less, a dip is timing noise). ``probe``: the seconds of a one-level
    step after ``PROBE_IDLE`` steps at 0 (0: not measured, a probe costs ``step_seconds(1)``)."""

    lengths: tuple[int, ...]
    draft: tuple[float, ...]
    verify: tuple[float, ...]
    other: tuple[float, ...]
    probe: float = 0.0

    def __post_init__(self) -> None:
        lengths = tuple(self.lengths)
        if not lengths or lengths[0] != 0 or any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise ValueError(f"step costs: lengths must ascend from 0, got {list(lengths)}")
        for name in ("draft", "verify", "other"):
            values = tuple(float(v) for v in getattr(self, name))
            if len(values) != len(lengths) or any(not v >= 0 or v == float("inf") for v in values):
                raise ValueError(f"step costs: {name} must be {len(lengths)} finite seconds >= 0, got {list(values)}")
            object.__setattr__(self, name, rising(values))
        object.__setattr__(self, "lengths", lengths)
        if not 0 <= float(self.probe) < float("inf"):
            raise ValueError(f"step costs: probe must be finite seconds >= 0, got {self.probe}")
        object.__setattr__(self, "probe", float(self.probe))
        if self.draft[0] + self.verify[0] + self.other[0] <= 0:
            raise ValueError("step costs: a step without drafting (k = 0) must take some time, got 0 s")

    @property
    def longest(self) -> int:
        return self.lengths[-1]

    def _at(self, values: tuple[float, ...], k: int) -> float:
        if k >= self.longest:  # past the profile: the last slope goes on
            if len(values) == 1:
                return values[-1]
            slope = (values[-1] - values[-2]) / (self.lengths[-1] - self.lengths[-2])
            return values[-1] + slope * (k - self.longest)
        i = next(i for i, n in enumerate(self.lengths) if n >= k)
        if self.lengths[i] == k:
            return values[i]
        lo, hi = self.lengths[i - 1], self.lengths[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (k - lo) / (hi - lo)

    def after_drafting(self, k: int, drafted: int) -> float:
        """Seconds of a step that drafted ``drafted`` levels and verifies the first ``k`` (k <= drafted): the
        drafting of ``drafted``, the verify of k + 1 tokens and the rest at k (a block drafter's cut)."""
        return self._at(self.draft, drafted) + self._at(self.verify, k) + self._at(self.other, k)

    def step_seconds(self, k: int) -> float:
        """Seconds of a step drafting ``k`` levels: drafting + the verify of k + 1 tokens + the rest."""
        return self._at(self.draft, k) + self._at(self.verify, k) + self._at(self.other, k)

    def probe_seconds(self) -> float:
        """Seconds of the chooser's probe: ``probe`` where measured, else a one-level step's."""
        return self.probe or self.step_seconds(1)

    def to_json(self) -> dict:
        return {"lengths": list(self.lengths), "draft": list(self.draft), "verify": list(self.verify),
                "other": list(self.other), "probe": self.probe}


def rising(values: tuple[float, ...]) -> tuple[float, ...]:
    """The non-decreasing sequence nearest ``values`` in least squares (pool adjacent violators: a run that
    falls is replaced by its mean, so one slow measurement does not raise every longer draft's cost)."""
    blocks: list[list[float]] = []  # [mean, size]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return tuple(m for m, n in blocks for _ in range(int(n)))


def curve_name(batch: int, greedy: bool) -> str:
    """The name of a batch size's curve in a ``CostModel`` ("1/greedy", "4/sampled")."""
    return f"{batch}/{'greedy' if greedy else 'sampled'}"


@dataclass
class CostModel:
    """``curves``: ``curve_name(batch, greedy)`` -> ``StepCosts``; ``key``: what they were measured under; ``path``:
    where they are kept (None: in memory only, as a test's)."""

    curves: dict[str, StepCosts] = field(default_factory=dict)
    key: dict = field(default_factory=dict)
    path: Path | None = None

    def curve(self, batch: int, greedy: bool) -> StepCosts | None:
        return self.curves.get(curve_name(batch, greedy))

    def save(self) -> None:
        """Written whole to a temporary file and renamed over ``path`` (a reader never sees half a file)."""
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"version": VERSION, "key": self.key,
                  "curves": {name: c.to_json() for name, c in sorted(self.curves.items())}}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.path)


def load_costs(key: dict) -> CostModel:
    """The cost model kept for ``key`` (its curves; none when nothing was measured under this key, or the record is
    of another version or key); a malformed file fails with a message naming it."""
    path = keyed_cache_file(COSTS_DIR, key)
    if not path.is_file():
        return CostModel({}, key, path)
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != VERSION or raw.get("key") != json.loads(json.dumps(key)):
            return CostModel({}, key, path)  # measured under something else: measure again
        curves = {str(name): StepCosts(tuple(c["lengths"]), tuple(c["draft"]), tuple(c["verify"]), tuple(c["other"]),
                                       c["probe"]) for name, c in raw["curves"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a step-cost record ({type(err).__name__}: {err}); delete it and the next "
                         "decode measures again") from err
    return CostModel(curves, key, path)
