"""One drafter, a draft-length policy per sampling mode and batch: the CPU default for EAGLE heads' chains.

``ByTemperature`` holds two wrappers of the same drafter: ``greedy`` drafts a single row at temperature 0 (the
adaptive chain, ``AdaptiveLength``: +2 after a fully accepted step, -1 otherwise, never below 1), ``sampled``
everything else (the cost-aware chain, ``CostAwareLength``: each step's length chosen for tokens per second from
the measured step costs of this batch size, 0 allowed). Sampled drafts are accepted far less often than greedy
ones (the demo head on README's prompt: about 0.4 of its first drafts at temperature 0.7 and 0.3 at 1.0, against
nearly all at 0, docs/benchmarks.md), so a chain that never stops drafting decodes slower than the target alone
there; and a batch's verify carries every row's chain, so on a CPU the best fixed length shrinks with the batch
(plain decoding at 16 rows: the adaptive chain measured 0.80-0.85x the best fixed plan at 4 rows and 0.48x at 16,
docs/benchmarks.md), while a single greedy row drafting the adaptive chain measured faster than the chooser. The
generator says which decode starts and with how many rows (``begin``, before ``new_rows``); until then, and for a
caller driving the verbs itself, the greedy one drafts. Only what is drafted changes: acceptance is the
generator's (lossless).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor

from draftsmith.infer.drafters.base import Draft, Drafter, Sampling


class ByTemperature(Drafter):
    """``greedy`` for one row at temperature 0, ``sampled`` above it or for several rows; both must wrap the same
    drafter (their ``drafter``)."""

    def __init__(self, greedy: Drafter, sampled: Drafter) -> None:
        for name, wrapper in (("greedy", greedy), ("sampled", sampled)):
            if not isinstance(wrapper, Drafter):
                raise TypeError(f"ByTemperature {name} must be a drafter, got {type(wrapper).__name__}")
        inner = getattr(greedy, "drafter", None)
        if inner is None or getattr(sampled, "drafter", None) is not inner:
            raise ValueError("ByTemperature needs two wrappers of one drafter (greedy.drafter is sampled.drafter), "
                             f"got {type(greedy).__name__} and {type(sampled).__name__} of different ones")
        self.greedy, self.sampled, self.active = greedy, sampled, greedy
        self.sampling = Sampling()  # the decode's, from ``begin``
        self.aux_layer_ids = inner.aux_layer_ids
        self.max_nodes = inner.max_nodes

    @property
    def drafter(self) -> Drafter:
        """The wrapper drafting this decode (what ``infer.cost_profile.chooser_of`` looks through)."""
        return self.active

    def begin(self, sampling: Sampling, rows: int = 1) -> None:
        self.sampling = sampling
        self.active = self.greedy if sampling.greedy and rows == 1 else self.sampled
        self.active.begin(sampling, rows)

    def compile_with(self, compile: bool | str) -> None:
        self.greedy.compile_with(compile)  # one inner drafter: once is enough

    def before_draft(self, cache: Any, lengths: list[int], pads: list[int]) -> None:
        self.active.before_draft(cache, lengths, pads)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[Any]:
        return self.active.new_rows(prompts, lengths)

    def observe_rows(self, states: list[Any], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        self.active.observe_rows(states, features, next_tokens)

    def propose_rows(self, states: list[Any], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        if sampling.greedy != self.sampling.greedy or (self.active is self.greedy and not sampling.greedy):
            raise ValueError(f"ByTemperature began a {'greedy' if self.sampling.greedy else 'sampled'} decode "
                             f"but is asked for a draft at temperature {sampling.temperature}: call begin(sampling) "
                             "before new_rows")
        return self.active.propose_rows(states, roots, sampling, max_depths)
