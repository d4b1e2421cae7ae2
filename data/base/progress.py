"""Progress that reaches a log file too: a tqdm bar on a terminal, else one line every ``every_s``
seconds (tqdm's ``disable=None`` would print nothing for the whole run when stderr is a file)."""
from __future__ import annotations

import sys
import time


class LineProgress:
    """The part of tqdm's interface our loops use (``update``, ``set_postfix``, ``close``), as lines."""

    def __init__(self, total: int, desc: str, every_s: float = 60.0, stream=None) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.n, self.postfix = 0, ""
        self.start = self.last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s or self.n == self.total:
            self.last = now
            self._line(now)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def close(self) -> None:
        pass

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        eta = elapsed / self.n * (self.total - self.n) if self.n else 0.0
        tail = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}/{self.total} ({elapsed / 60:.1f} min, about {eta / 60:.1f} min left{tail})",
              file=self.stream, flush=True)


def progress(total: int, desc: str, enabled: bool = True, every_s: float = 60.0):
    """A tqdm bar when stderr is a terminal, a ``LineProgress`` when it is not, nothing when not ``enabled``."""
    from tqdm.auto import tqdm

    if not enabled:
        return tqdm(total=total, desc=desc, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc)
    return LineProgress(total, desc, every_s)
