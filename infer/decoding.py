"""One ``generate`` call in progress (``SpeculativeGenerator.start`` -> ``step`` ... -> ``finish``): its settings,
its instruments and its state, kept apart (``Decoding``), and the stats a call leaves (``GenerationStats``)."""
from __future__ import annotations

import dataclasses
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
    # Acceptance in vLLM's names (vllm/v1/spec_decode/metrics.py, SpecDecodingStats), counted per row-step that
    # drafted at least one token (a "draft"); accepted drafts leave the bonus out and are counted before a row's cut
    # at EOS or its budget, as vLLM's scheduler counts them. Pool calls with ``pooled`` (counts summed, then divided).
    num_drafts: int = 0
    num_draft_tokens: int = 0  # tokens drafted (a tree's nodes, root left out)
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose position i was accepted
    # accepted drafts of one draft -> how many drafts accepted that many (ours; per_pos is its cumulative form)
    acceptance_histogram: dict[int, int] = field(default_factory=dict)

    def count_budget(self, drafted: int) -> None:
        """One row-step that drafted ``drafted`` tokens."""
        self.draft_budgets[drafted] = self.draft_budgets.get(drafted, 0) + 1

    def count_draft(self, drafted: int, accepted: int) -> None:
        """One row-step's draft of ``drafted`` tokens of which the verify accepted ``accepted`` (the bonus left
        out); a step that drafted nothing is no draft (vLLM counts the requests it scheduled drafts for)."""
        if drafted < 1:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (accepted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1
        self.acceptance_histogram[accepted] = self.acceptance_histogram.get(accepted, 0) + 1

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's: 1 + accepted drafts per draft (the bonus included; 1.0 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        """vLLM's: accepted drafts over drafted tokens (nan before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """vLLM's per-position acceptance rate: drafts accepted at position i over drafts."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    def acceptance(self) -> dict:
        """The acceptance counts and vLLM's rates from them, under vLLM's names (JSON-ready)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_histogram": {str(k): v for k, v in sorted(self.acceptance_histogram.items())},
                "mean_acceptance_length": self.mean_acceptance_length,
                "draft_acceptance_rate": self.draft_acceptance_rate if self.num_draft_tokens else None,
                "acceptance_rate_per_pos": self.acceptance_rate_per_pos}

    @classmethod
    def pooled(cls, stats: "list[GenerationStats]") -> "GenerationStats":
        """Several calls as one: every count, time and per-key or per-position count summed (so τ and vLLM's
        rates of the result are ratios of sums over the calls, never means of per-call ratios)."""
        out = cls()
        for one in stats:
            for f in dataclasses.fields(cls):
                mine, theirs = getattr(out, f.name), getattr(one, f.name)
                if isinstance(mine, dict):
                    for k, v in theirs.items():
                        mine[k] = mine.get(k, 0) + v
                elif isinstance(mine, list):
                    mine.extend([0] * (len(theirs) - len(mine)))
                    for i, v in enumerate(theirs):
                        mine[i] += v
                else:
                    setattr(out, f.name, mine + theirs)
        return out

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
