"""Adaptive draft length for any drafter (HF assisted generation's heuristic).

The wrapper caps each proposal's depth at a running length: +2 after a step that accepted every
drafted level, -1 (not below 1) otherwise. It works with every drafter that honours ``max_depth``
in ``propose_rows`` (all of draftsmith's do: chains are cut, trees lose their deeper levels). The
number of accepted drafts is read from ``observe_rows``: after a step it receives the accepted drafts
plus the bonus token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from draftsmith.data.base.checks import count
from draftsmith.infer.drafters.base import Draft, Drafter, Sampling


@dataclass
class AdaptiveState:
    inner: Any
    length: int
    proposed: int | None = None  # depth of the last proposal; None before the first step


class AdaptiveLength(Drafter):
    """Wrap ``drafter``; ``initial`` is the first step's length, ``maximum`` its cap."""

    def __init__(self, drafter: Drafter, initial: int = 4, maximum: int = 16) -> None:
        if not isinstance(drafter, Drafter):
            raise TypeError(f"AdaptiveLength wraps a drafter, got {type(drafter).__name__} (for a head: "
                            "AdaptiveLength(infer.drafters.make_drafter(head, target, Chain(n))))")
        initial, maximum = count("AdaptiveLength initial", initial), count("AdaptiveLength maximum", maximum)
        if initial > maximum:
            raise ValueError(f"AdaptiveLength needs initial <= maximum, got {initial} > {maximum}")
        self.drafter, self.initial, self.maximum = drafter, initial, maximum
        self.aux_layer_ids = drafter.aux_layer_ids
        self.max_nodes = drafter.max_nodes  # the inner drafter's budget bounds every proposal

    def compile_with(self, compile: bool | str) -> None:
        self.drafter.compile_with(compile)

    def begin(self, sampling: Sampling, rows: int = 1) -> None:
        self.drafter.begin(sampling, rows)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[AdaptiveState]:
        return [AdaptiveState(inner, self.initial) for inner in self.drafter.new_rows(prompts, lengths)]

    def observe_rows(self, states: list[AdaptiveState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        for state, tokens in zip(states, next_tokens):
            if state.proposed:  # a step drafted something: next_tokens = accepted drafts + bonus
                full = tokens.shape[1] - 1 >= state.proposed
                state.length = min(state.length + 2, self.maximum) if full else max(state.length - 1, 1)
        self.drafter.observe_rows([s.inner for s in states], features, next_tokens)

    def propose_rows(self, states: list[AdaptiveState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """The inner drafter's rows at once, each capped at its own running length."""
        drafts = self.drafter.propose_rows([s.inner for s in states], roots, sampling,
                                           [min(d, s.length) for s, d in zip(states, max_depths)])
        for state, draft in zip(states, drafts):
            state.proposed = draft.tree.retrieve_indices.shape[1] - 1  # the draft's depth
        return drafts
