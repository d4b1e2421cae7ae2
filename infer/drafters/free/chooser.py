"""The draft length chosen each step for tokens per second, 0 (plain decoding) allowed.

``CostAwareLength`` wraps a chain drafter. Each row keeps, per draft depth d, how often a draft that reached d was
accepted (counts decayed by ``DECAY`` per observation, so the estimate follows the text), and reads its
conditional acceptance p_d from them with a prior: depth 1's is ``prior``, depth d's the estimate at d - 1 (a
depth never reached is trusted as much as the last one reached). A step drafting k levels is expected to emit
E(k) = 1 + p_1 + p_1 p_2 + ... + p_1...p_k tokens (the bonus token, then each accepted draft) and to take
``StepCosts.step_seconds(k)`` seconds (``infer.cost_model``: measured per target, drafter, device, dtype and thread
count, per batch size and sampling mode); the row drafts the k with the most E(k) / seconds(k), the shorter on a
tie. A row at 0 learns nothing, so after ``probe_every`` steps at 0 it drafts one level (a probe) to find out
whether drafting pays again; each probe doubles the wait before the next one (up to ``MAX_WAIT`` times
``probe_every``), and the wait starts over only when the row chooses to draft again. (A hit used to start it over
too: sampled, where about 0.4 of the demo head's drafts are kept, below what a drafted level costs, half the probes
hit and the row probed every 8 steps for nothing.)

A row at 0 costs what plain decoding costs: its drafter does not observe the accepted tokens then; they wait and
are observed at once (one head forward) before the row drafts again. Only what is drafted changes: acceptance is
the generator's, as for any drafter (lossless).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.data.base.checks import count, probability
from draftsmith.infer.cost_model import CostModel, StepCosts, curve_name
from draftsmith.infer.drafters.base import Draft, Drafter, Sampling, root_only

DECAY = 0.9  # per observation of a depth: about the last ten observations count
PRIOR = 0.6  # a new row's acceptance at depth 1 before it has drafted
PRIOR_WEIGHT = 1.0  # the prior counts as this many observations
PROBE_EVERY = 8  # steps at 0 before a one-level probe
MAX_WAIT = 8  # the wait after missed probes grows to at most this many times probe_every


@dataclass
class ChooserState:
    inner: Any
    hits: list[float]  # per depth (index d - 1): decayed count of accepted drafts at d
    tries: list[float]  # per depth: decayed count of drafts that reached d
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (features, next tokens) not yet observed
    proposed: int = 0  # levels of the last draft (0: none, nothing to learn)
    idle: int = 0  # steps at 0 since the last draft
    wait: int = PROBE_EVERY  # steps at 0 before the next probe
    probing: bool = False  # the last draft was a probe


def acceptance(hits: list[float], tries: list[float], prior: float, weight: float = PRIOR_WEIGHT) -> list[float]:
    """Per depth, the conditional acceptance p_d: (hits + weight * p_{d-1}) / (tries + weight), p_0 = ``prior``."""
    estimates, mean = [], prior
    for h, t in zip(hits, tries):
        mean = (h + weight * mean) / (t + weight)
        estimates.append(mean)
    return estimates


@functools.lru_cache(maxsize=64)
def step_table(costs: StepCosts, longest: int) -> tuple[float, ...]:
    """``costs.step_seconds(k)`` for k = 0..``longest``, computed once per curve (a step reads it, not the curve)."""
    return tuple(costs.step_seconds(k) for k in range(longest + 1))


def best_length(p: list[float], costs: StepCosts, longest: int) -> int:
    """The draft length in 0..``longest`` with the most expected tokens per second (the shorter on a tie)."""
    longest = min(longest, len(p))
    seconds = step_table(costs, longest)
    best, best_rate = 0, 1.0 / seconds[0]
    expected, survive = 1.0, 1.0
    for k in range(1, longest + 1):
        survive *= p[k - 1]
        expected += survive
        rate = expected / seconds[k]
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def head_identity(drafter: Drafter) -> dict:
    """What a drafter's step costs depend on besides the target: its class and its head's parameter shapes."""
    head = getattr(drafter, "head", None)
    params = head.named_parameters() if isinstance(head, nn.Module) else []
    shapes = [(n, list(p.shape), str(p.dtype)) for n, p in params]
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:12]
    return {"drafter": type(drafter).__name__, "head_shapes": digest}


class CostAwareLength(Drafter):
    """Wrap a chain ``drafter`` drafting at most ``maximum`` levels; ``costs``: a ``CostModel`` (None: the generator
    measures one, ``infer.cost_profile``) or one ``StepCosts`` for every batch size and sampling mode (a test's)."""

    def __init__(self, drafter: Drafter, maximum: int = 16, costs: CostModel | StepCosts | None = None,
                 prior: float = PRIOR, probe_every: int = PROBE_EVERY) -> None:
        if not isinstance(drafter, Drafter):
            raise TypeError(f"CostAwareLength wraps a drafter, got {type(drafter).__name__}")
        if not (costs is None or isinstance(costs, (CostModel, StepCosts))):
            raise TypeError(f"costs must be a CostModel, a StepCosts or None, got {type(costs).__name__}")
        self.drafter, self.maximum = drafter, count("CostAwareLength maximum", maximum)
        self.prior = probability("CostAwareLength prior", prior, allow_none=False)
        self.probe_every = count("CostAwareLength probe_every", probe_every)
        self.costs = costs
        self.forced: int | None = None  # every row drafts this many levels (the cost profile's steps)
        self.identity = head_identity(drafter)
        self.aux_layer_ids = drafter.aux_layer_ids
        self.max_nodes = drafter.max_nodes
        self._batch = 1

    def compile_with(self, compile: bool | str) -> None:
        self.drafter.compile_with(compile)

    def begin(self, sampling: Sampling) -> None:
        self.drafter.begin(sampling)

    def before_draft(self, cache: Any, lengths: list[int], pads: list[int]) -> None:
        self.drafter.before_draft(cache, lengths, pads)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[ChooserState]:
        self._batch = len(prompts)
        return [ChooserState(inner, [0.0] * self.maximum, [0.0] * self.maximum, wait=self.probe_every)
                for inner in self.drafter.new_rows(prompts, lengths)]

    def observe_rows(self, states: list[ChooserState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        """Each row's acceptance counts from its last draft (next_tokens: the accepted drafts + the bonus); the
        tokens wait for the row's next draft to be observed."""
        for state, feats, tokens in zip(states, features, next_tokens):
            accepted = tokens.shape[1] - 1
            if state.probing:  # the next probe waits twice as long, unless the row drafts again by choice (_choose)
                state.wait = min(2 * state.wait, MAX_WAIT * self.probe_every)
            for d in range(min(state.proposed, accepted + 1)):  # depths reached: every accepted one, then a miss
                state.tries[d] = DECAY * state.tries[d] + 1.0
                state.hits[d] = DECAY * state.hits[d] + (1.0 if d < accepted else 0.0)
            state.pending.append((feats, tokens))

    def _curve(self, greedy: bool) -> StepCosts:
        """The step costs of this batch size and sampling mode."""
        costs = self.costs
        curve = costs if isinstance(costs, StepCosts) else None if costs is None else costs.curve(self._batch, greedy)
        if curve is None:
            raise ValueError(f"CostAwareLength has no step costs for {curve_name(self._batch, greedy)}: pass costs= "
                             "or decode with SpeculativeGenerator, which measures them (infer.cost_profile)")
        return curve

    def _choose(self, state: ChooserState, curve: StepCosts, max_depth: int) -> int:
        """This row's draft length for the next step (a probe of 1 after ``state.wait`` steps at 0)."""
        longest = min(max_depth, self.maximum)
        if self.forced is not None:
            return min(self.forced, longest)
        k = best_length(acceptance(state.hits, state.tries, self.prior), curve, longest)
        state.probing = k == 0 and state.idle >= state.wait
        if state.probing:
            k = min(1, longest)
        elif k:  # drafting pays again: the waits between probes start over
            state.wait = self.probe_every
        state.idle = 0 if k else state.idle + 1
        return k

    def propose_rows(self, states: list[ChooserState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """The rows that draft observe their waiting tokens, then draft at once; the others verify their root."""
        curve = self._curve(sampling.greedy) if self.forced is None else None
        cuts = self.drafter.use_step_costs(curve)  # DSpark cuts each row's block by its confidence under them
        lengths = [self._choose(s, curve, d) for s, d in zip(states, max_depths)]
        if cuts:  # a row that drafts drafts its whole block: what is verified of it, the drafter chooses
            lengths = [min(d, self.maximum) if k else 0 for k, d in zip(lengths, max_depths)]
        drafting = [i for i, k in enumerate(lengths) if k > 0]
        drafts = [root_only(root) for root in roots]
        for state in states:
            state.proposed = 0
        if not drafting:
            return drafts
        waiting = [states[i] for i in drafting if states[i].pending]
        if waiting:
            self.drafter.observe_rows([s.inner for s in waiting],
                                      [torch.cat([f for f, _ in s.pending], dim=1) for s in waiting],
                                      [torch.cat([t for _, t in s.pending], dim=1) for s in waiting])
            for s in waiting:
                s.pending = []
        proposed = self.drafter.propose_rows([states[i].inner for i in drafting], [roots[i] for i in drafting],
                                             sampling, [lengths[i] for i in drafting])
        for i, draft in zip(drafting, proposed):
            drafts[i] = draft
            states[i].proposed = draft.tree.retrieve_indices.shape[1] - 1  # the draft's depth
        return drafts
