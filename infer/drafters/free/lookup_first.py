"""Prompt lookup first, a drafter when lookup finds nothing: the suffix + model hybrid.

Snowflake's Arctic Inference pairs suffix decoding with a model speculator this way (arXiv 2411.04975,
SuffixDecoding: "fall back to the model-based speculator when the suffix match is short"): on
repetitive output (code, edits, templated answers) a lookup continuation is long and costs no forward;
elsewhere the trained drafter drafts. Each step and row: prompt lookup over prompt + output proposes a
continuation; when it has at least ``min_lookup`` tokens that draft is verified, else the inner drafter
(a head, a draft LM…) drafts.

The inner drafter is not run on lookup steps: the features and tokens it must see are kept and
observed in one forward just before its next draft (its state after that is what it would be
after observing each step — attention is causal — so only the number of its forwards changes).
Lossless either way: a lookup draft is deterministic (``q`` None), the inner draft carries its own law.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from draftsmith.data.base.checks import count
from draftsmith.infer.drafters.base import Draft, Drafter, Sampling
from draftsmith.infer.drafters.free.ngram import NgramDrafter


@dataclass
class LookupFirstState:
    lookup: Any
    inner: Any
    features: list[Tensor] = field(default_factory=list)  # (1, A_i, F) not yet observed by the inner drafter
    tokens: list[Tensor] = field(default_factory=list)  # (1, A_i)


class LookupFirst(Drafter):
    """``LookupFirst(drafter, NgramDrafter(...), min_lookup=2)``: lookup drafts when its continuation has
    at least ``min_lookup`` tokens, ``drafter`` otherwise."""

    def __init__(self, drafter: Drafter, lookup: NgramDrafter | None = None, min_lookup: int = 2) -> None:
        if not isinstance(drafter, Drafter):
            raise TypeError(f"LookupFirst wraps a drafter, got {type(drafter).__name__} (for a head: "
                            "LookupFirst(infer.drafters.make_drafter(head, target)))")
        self.lookup = NgramDrafter() if lookup is None else lookup
        if not isinstance(self.lookup, NgramDrafter):
            raise TypeError(f"LookupFirst looks up with an NgramDrafter, not {type(self.lookup).__name__}")
        self.drafter = drafter
        self.min_lookup = count("LookupFirst min_lookup", min_lookup)
        self.aux_layer_ids = drafter.aux_layer_ids
        # the larger of the two drafts (None: the inner drafter has no bound, so neither has this)
        self.max_nodes = None if drafter.max_nodes is None else max(drafter.max_nodes, self.lookup.max_nodes)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[LookupFirstState]:
        return [LookupFirstState(lookup, inner) for lookup, inner in
                zip(self.lookup.new_rows(prompts, lengths), self.drafter.new_rows(prompts, lengths))]

    def compile_with(self, compile: bool | str) -> None:
        self.drafter.compile_with(compile)

    def begin(self, sampling: Sampling, rows: int = 1) -> None:
        self.drafter.begin(sampling, rows)

    def observe_rows(self, states: list[LookupFirstState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        self.lookup.observe_rows([s.lookup for s in states], features, next_tokens)
        for state, feats, tokens in zip(states, features, next_tokens):
            state.features.append(feats)
            state.tokens.append(tokens)

    def _catch_up(self, states: list[LookupFirstState]) -> None:
        """The inner drafter observes what it missed, every row at once (one forward for a head)."""
        pending = [s for s in states if s.tokens]
        if pending:
            self.drafter.observe_rows([s.inner for s in pending], [torch.cat(s.features, dim=1) for s in pending],
                                      [torch.cat(s.tokens, dim=1) for s in pending])
        for s in pending:
            s.features, s.tokens = [], []

    def propose_rows(self, states: list[LookupFirstState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        drafts = self.lookup.propose_rows([s.lookup for s in states], roots, sampling, max_depths)
        inner = [i for i, d in enumerate(drafts) if d.tokens.shape[0] - 1 < self.min_lookup]
        if inner:
            rows = [states[i] for i in inner]
            self._catch_up(rows)
            for i, draft in zip(inner, self.drafter.propose_rows([s.inner for s in rows], [roots[i] for i in inner],
                                                                 sampling, [max_depths[i] for i in inner])):
                drafts[i] = draft
        return drafts
