"""The draft length chosen each step for tokens per second, 0 (plain decoding) allowed.

``CostAwareLength`` wraps a chain drafter, or a dynamic tree's (``chosen_tree``: k levels are the tree cut to depth k,
its most likely nodes kept, and the counts below are of the accepted path's depth, as a chain's). Each row keeps, per
draft depth d, how often a draft that reached d was accepted (counts decayed by ``DECAY`` per observation, so the
estimate follows the text), and reads its conditional acceptance p_d from them with a prior: depth 1's is ``prior``,
depth d's the estimate at d - 1 as far as its tries vouch for it, the prior otherwise (``acceptance``). A row drafting k
levels is expected to emit E(k) = 1 + p_1 + p_1 p_2 + ... + p_1...p_k tokens (the bonus token, then each accepted
draft), and a step of k levels takes ``StepCosts.step_seconds(k)`` seconds (``infer.cost_model``: measured per target,
drafter, device, dtype and thread count, per batch size and sampling mode, every row of the batch at k). Every row of
the batch drafts the one k with the most expected tokens per second, the rows' E(k) summed (a batch's verify carries
its longest chain, so rows of different lengths would pay for the longest; each row is still cut to the levels it has
room for), the shorter on a tie. At 0 the rows learn nothing, so after a wait at 0 they draft one level (a probe) to
find out whether drafting pays again; each probe that leaves the rows at 0 doubles the wait (up to 2 ** ``MAX_MISSES``
times the first), and the wait starts over only when a probe makes them choose to draft. (A hit used to start it over
too: sampled, where about 0.4 of the demo head's drafts are kept, below what a drafted level costs, half the probes
hit and the row probed every 8 steps for nothing.) No probe is drafted when the longest row has fewer tokens left than
the wait: what it found would pay for fewer steps than the decode waited.

A greedy decode's first wait is ``probe_every`` steps, doubled as often as the last greedy decode of its batch size
missed (on a 16-row CPU batch, where drafting never paid, each decode spent its first probes finding that out
again); what is drafted never changes a greedy output, so this carry keeps every output the same. A sampled decode's
draws follow its drafts, and a seeded call must sample the same whatever ran before it, so it carries nothing: its
first wait is ``probe_every`` steps or, if more, as many as make a probe's measured cost (``StepCosts.probe``: its
drafter first observes every token it skipped; on a 16-row CPU batch several plain steps) ``PROBE_SHARE`` of
their time.

A row at 0 costs what plain decoding costs: its drafter does not observe the accepted tokens then; they wait and
are observed at once (one head forward) before the row drafts again. Only what is drafted changes: acceptance is
the generator's, as for any drafter (lossless).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
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
PROBE_EVERY = 8  # the fewest steps at 0 before a one-level probe
PROBE_SHARE = 0.05  # a probe waits for steps at 0 costing at least what it adds over a plain step / this
MAX_MISSES = 3  # missed probes double the wait at most this many times (to 8 times the first)


@dataclass
class ChooserState:
    inner: Any
    hits: list[float]  # per depth (index d - 1): decayed count of accepted drafts at d
    tries: list[float]  # per depth: decayed count of drafts that reached d
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (features, next tokens) not yet observed
    proposed: int = 0  # levels of the last draft (0: none, nothing to learn)


def acceptance(hits: list[float], tries: list[float], prior: float, weight: float = PRIOR_WEIGHT) -> list[float]:
    """Per depth, the conditional acceptance p_d = (hits + weight * m_d) / (tries + weight). Its starting point m_d is
    ``prior`` at depth 1 and deeper the estimate at d - 1 as far as that depth's own tries vouch for it:
    m_d = (tries_{d-1} * p_{d-1} + weight * prior) / (tries_{d-1} + weight). One hit at depth 1 (p_1 = 0.8) starts
    depth 2 at 0.7 and depth 3 at the prior; ten hits start the next depth near them."""
    estimates, mean, seen = [], prior, 0.0
    for h, t in zip(hits, tries):
        start = (seen * mean + weight * prior) / (seen + weight)
        mean, seen = (h + weight * start) / (t + weight), t
        estimates.append(mean)
    return estimates


@functools.lru_cache(maxsize=64)
def step_table(costs: StepCosts, longest: int) -> tuple[float, ...]:
    """``costs.step_seconds(k)`` for k = 0..``longest``, computed once per curve (a step reads it, not the curve)."""
    return tuple(costs.step_seconds(k) for k in range(longest + 1))


def best_length(p: list[float], costs: StepCosts, longest: int) -> int:
    """The draft length in 0..``longest`` with the most expected tokens per second for one row (the shorter on a
    tie): ``batch_length`` of that row alone."""
    return batch_length([p], [longest], costs, longest)


def batch_length(rows: list[list[float]], budgets: list[int], costs: StepCosts, longest: int) -> int:
    """The one draft length in 0..``longest`` for every row of a batch with the most expected tokens per second:
    the rows' E_r(min(k, budget_r)) summed over a step of k levels' seconds (the profile's: every row at k), the
    shorter on a tie. ``rows``: each row's conditional acceptance per depth; ``budgets``: the levels each may draft."""
    longest = min(longest, max(len(p) for p in rows))
    seconds = step_table(costs, longest)
    best, best_rate = 0, len(rows) / seconds[0]
    expected = [1.0] * len(rows)
    survive = [1.0] * len(rows)
    for k in range(1, longest + 1):
        for r, p in enumerate(rows):
            if k <= min(budgets[r], len(p)):
                survive[r] *= p[k - 1]
                expected[r] += survive[r]
        rate = sum(expected) / seconds[k]
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def first_wait(curve: StepCosts, probe_every: int, greedy: bool) -> int:
    """Steps at 0 before a decode's first probe. Greedy: ``probe_every`` (the misses carried from the last greedy
    decode of the batch size lengthen it). Sampled (nothing carried): ``probe_every``, or the steps whose plain
    decoding costs 1 / ``PROBE_SHARE`` times what a probe (``StepCosts.probe_seconds``) adds to a plain step, if
    more."""
    if greedy:
        return probe_every
    plain = curve.step_seconds(0)
    excess = (curve.probe_seconds() - plain) / (PROBE_SHARE * plain)
    return max(probe_every, math.ceil(excess - 1e-9))  # 1e-9: 4.000...1 is 4


def head_identity(drafter: Drafter) -> dict:
    """What a drafter's step costs depend on besides the target: its class and its head's parameter shapes."""
    head = getattr(drafter, "head", None)
    params = head.named_parameters() if isinstance(head, nn.Module) else []
    shapes = [(n, list(p.shape), str(p.dtype)) for n, p in params]
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:12]
    return {"drafter": type(drafter).__name__, "head_shapes": digest}


class CostAwareLength(Drafter):
    """Wrap a chain or dynamic-tree ``drafter`` drafting at most ``maximum`` levels; ``costs``: a ``CostModel``
    (None: the generator measures one, ``infer.cost_profile``) or one ``StepCosts`` for every batch size and sampling
    mode (a test's)."""

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
        self.idle = 0  # this decode's steps at 0 since its last draft
        self.misses = 0  # probes since drafting last paid: the wait is ``first_wait`` x 2 ** misses
        self.probing = False  # the last draft was a probe
        self._chosen: tuple[int, int] | None = None  # (rows, k) last chosen; (rows, 0) stands while nothing is learnt
        self._greedy = True  # this decode's sampling mode (``begin``)
        self._misses: dict[int, int] = {}  # batch size -> the misses a greedy decode of that size ended with
        self._probed = False  # the last draft was a probe, now observed

    def compile_with(self, compile: bool | str) -> None:
        self.drafter.compile_with(compile)

    def begin(self, sampling: Sampling, rows: int = 1) -> None:
        self._greedy = sampling.greedy
        self.drafter.begin(sampling, rows)

    def before_draft(self, cache: Any, lengths: list[int], pads: list[int]) -> None:
        self.drafter.before_draft(cache, lengths, pads)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[ChooserState]:
        # a greedy decode starts probing as the last greedy decode of its size ended (what is drafted never changes a
        # greedy output, so carrying this keeps every output the same); a sampled one carries nothing: its draws
        # follow its drafts, and a seeded call must sample the same whatever ran before it
        misses = self._misses.get(len(prompts), 0) if self._greedy else 0
        self._batch, self.idle, self.misses = len(prompts), 0, misses
        self.probing, self._chosen, self._probed = False, None, False
        return [ChooserState(inner, [0.0] * self.maximum, [0.0] * self.maximum)
                for inner in self.drafter.new_rows(prompts, lengths)]

    def observe_rows(self, states: list[ChooserState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        """Each row's acceptance counts from its last draft (next_tokens: the accepted drafts + the bonus); the
        tokens wait for the row's next draft to be observed."""
        if self.probing:  # the next probe waits twice as long, unless the rows draft again by choice (_choose)
            self.misses, self.probing = min(self.misses + 1, MAX_MISSES), False
            self._probed = True
            if self._greedy:
                self._misses[self._batch] = self.misses
        for state, feats, tokens in zip(states, features, next_tokens):
            accepted = tokens.shape[1] - 1
            if state.proposed:  # counts change: the next step chooses again
                self._chosen = None
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

    def _choose(self, states: list[ChooserState], curve: StepCosts, max_depths: list[int]) -> list[int]:
        """The rows' draft lengths for the next step: one length for every row (``batch_length``: a batch's verify
        carries its longest chain, and the profile timed every row at k), each row cut to its budget; a probe of 1
        after ``first_wait`` x 2 ** ``misses`` steps at 0, when the longest row has as many tokens left."""
        if self.forced is not None:
            return [min(self.forced, d, self.maximum) for d in max_depths]
        longest = min(max(max_depths), self.maximum)
        if self._chosen == (len(states), 0):  # nothing drafted since, so no count changed: still 0 (smaller budgets
            k = 0  # only lower what drafting is worth)
        else:
            k = batch_length([acceptance(s.hits, s.tries, self.prior) for s in states], max_depths, curve, longest)
        self._chosen = (len(states), k)
        wait = first_wait(curve, self.probe_every, self._greedy) * 2 ** self.misses
        self.probing = k == 0 and self.idle >= wait and max(max_depths) + 1 >= wait  # depths: tokens left - 1
        if self.probing:
            k = min(1, longest)
        elif k and self._probed:  # drafting pays again on a probe's evidence: the waits between probes start over
            self.misses = 0  # (a new decode drafting at its prior keeps the wait it started with)
            self._misses.pop(self._batch, None)
        self._probed = False
        self.idle = 0 if k else self.idle + 1
        return [min(k, d, self.maximum) for d in max_depths]

    def propose_rows(self, states: list[ChooserState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """The rows that draft observe their waiting tokens, then draft at once; the others verify their root."""
        curve = self._curve(sampling.greedy) if self.forced is None else None
        cuts = self.drafter.use_step_costs(curve)  # DSpark cuts each row's block by its confidence under them
        lengths = self._choose(states, curve, max_depths)
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
