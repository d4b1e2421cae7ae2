"""One ``generate`` call in progress (``SpeculativeGenerator.start`` -> ``step`` ... -> ``finish``): its settings,
its instruments and its state, kept apart (``Decoding``), and the stats a call leaves (``GenerationStats``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from draftsmith.data.base.device import sync
from draftsmith.infer.cache import StaticKVCache
from draftsmith.infer.drafters import Sampling


@dataclass
class GenerationStats:
    """What the last ``generate`` call did."""

    new_tokens: int = 0
    target_forwards: int = 0  # including the prefill
    steps: int = 0  # verification forwards
    step_tokens: int = 0  # tokens emitted by verification steps (accepted drafts + bonus)
    verified_tokens: int = 0  # tokens the verification forwards ran over (padded to the budget when static)
    # a hybrid target's rollback: forwards replaying accepted tokens after a partial accept, and their tokens;
    # with rollback="merged", the pending tokens verifies ran again in front of their drafts instead
    replays: int = 0
    replayed_tokens: int = 0
    pending_tokens: int = 0
    # drafted tokens per row and step -> how many row-steps drafted that many (0: the root alone, plain decoding;
    # a drafter choosing its length per step, infer.drafters.free.chooser, shows its choices here)
    draft_budgets: dict[int, int] = field(default_factory=dict)
    wall_time: float = 0.0  # seconds, compilation included (see compile_time)
    # Seconds spent in verify calls that compiled a new graph (first call per tree budget and
    # cache size); included in wall_time. Warm up once to measure decode speed alone.
    compile_time: float = 0.0
    # Seconds per phase ("prefill", "draft", "verify", "accept", "compact", "emit", "observe"; on a hybrid
    # target "rollback" too), filled only by a generator built with profile=True (it synchronises the device at every
    # phase end, so profiled runs are slower on GPU).
    phase_times: dict[str, float] = field(default_factory=dict)

    def count_budget(self, drafted: int) -> None:
        """One row-step that drafted ``drafted`` tokens."""
        self.draft_budgets[drafted] = self.draft_budgets.get(drafted, 0) + 1

    @property
    def tau(self) -> float:
        """Mean tokens per verification step (accepted drafts + bonus); 0.0 before any step."""
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


class PhaseClock:
    """Accumulates wall time per loop phase when enabled; a no-op otherwise (no device syncs)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        self.times: dict[str, float] = {}
        self.last = 0.0

    def start(self) -> None:
        if self.enabled:
            sync(self.device)  # sync: only when profiling
            self.last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to ``phase``."""
        if self.enabled:
            sync(self.device)  # sync: only when profiling
            now = time.perf_counter()
            self.times[phase] = self.times.get(phase, 0.0) + now - self.last
            self.last = now


@dataclass
class RowState:
    """Everything one row of a generation carries from step to step."""

    draft: Any  # the drafter's own state (head cache, last head output, ...)
    root: Tensor  # 0-d long: last emitted token, not yet in the target's cache
    emitted: list[Tensor] = field(default_factory=list)  # chunks of new tokens
    num_new: int = 0


@dataclass
class DecodeSettings:
    """What the caller asked for; fixed for the whole call."""

    sampling: Sampling
    eos: Tensor  # (E,) stop ids
    max_new_tokens: int
    levels: int | None  # the plan's draft levels for this batch size (None: the drafter's own; 0: none)
    input_ids: Tensor  # the prompts as given (the output starts with them, on their device)
    pad_id: int  # fills a row's output after its end


@dataclass
class DecodeInstruments:
    """What watches the call without steering it."""

    stats: GenerationStats
    clock: PhaseClock
    started: float  # perf_counter at the start
    streamer: Any = None  # HF's put/end streamer (batch size 1), or None


@dataclass
class DecodeState:
    """What the steps advance."""

    cache: StaticKVCache  # the target's KV (and a hybrid's recurrent states) of every row
    rows: list[RowState]
    done: list[bool]  # per row: stopped (EOS or budget)
    lengths: Tensor  # (B,) valid cache slots per row (prompt with its left pads, then accepted tokens)
    host_lengths: list[int]  # the same, on the host
    pads: Tensor  # (B,) left-pad columns per row
    host_pads: list[int]  # the same, on the host
    carry: Any = None  # the rollback's state between steps (infer.rollback: "merged"'s pending tokens); None: none


@dataclass
class Decoding:
    """One ``generate`` call in progress."""

    settings: DecodeSettings
    instruments: DecodeInstruments
    state: DecodeState

    def live(self) -> list[int]:
        """The rows still decoding."""
        return [b for b, done in enumerate(self.state.done) if not done]

    @property
    def finished(self) -> bool:
        """Every row has stopped (EOS or budget): ``finish`` may run."""
        return all(self.state.done)

    @property
    def stats(self) -> GenerationStats:
        return self.instruments.stats


__all__ = ["DecodeInstruments", "DecodeSettings", "DecodeState", "Decoding", "GenerationStats", "PhaseClock", "RowState"]
