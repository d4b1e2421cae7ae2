"""Measuring a generator's step costs (``infer.cost_model``) where its drafter chooses draft lengths by them.

``prepare_costs`` runs before a decode (``SpeculativeGenerator.start``): a ``CostAwareLength`` drafter without a
curve for this batch size and sampling mode gets one, read from the cache under the key of what it depends on
(``cost_key``: the target's identity, device, dtype, thread count and the drafter's head), or measured there
once and saved. Measuring decodes a fixed random prompt with every row drafting exactly k levels, for each
profiled k, timing a few steps per k through the generator's own loop (draft, verify, the rest; a hybrid's
rollback included), the k interleaved over a few rounds, and a probe (one level after ``PROBE_IDLE`` steps at 0)
each round: a few seconds on a CPU for the demo target. Torch's random state is the same after it, so a
seeded call samples what it would have without the profile. An injected ``StepCosts`` is never measured.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from draftsmith.data.base.device import sync
from draftsmith.infer.cost_model import PROBE_IDLE, StepCosts, curve_name, load_costs
from draftsmith.infer.decoding import PhaseClock
from draftsmith.infer.drafters import Sampling
from draftsmith.infer.drafters.free.chooser import CostAwareLength
from draftsmith.target.lean import lean_stack
from draftsmith.target.model import loaded_target_identity

PROMPT_TOKENS = 48
ROUNDS, WARM_STEPS, TIMED_STEPS = 5, 1, 2
# plain steps right after a prefill run slow and speed up over about a dozen steps (16 CPU rows: 6.1 ms falling to
# 5.0 by step 13, while a drafting step is steady from its second): k = 0 is timed after this many
PLAIN_WARM_STEPS = 12
PROFILED = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # draft lengths timed (up to the drafter's longest, which is too)


def chooser_of(drafter: Any) -> CostAwareLength | None:
    """The ``CostAwareLength`` a drafter is or wraps (``LookupFirst``'s fallback), or None."""
    while drafter is not None and not isinstance(drafter, CostAwareLength):
        drafter = getattr(drafter, "drafter", None)
    return drafter


def cost_key(gen: Any, chooser: CostAwareLength) -> dict:
    """What a generator's step costs depend on: target, device, dtype, CPU threads, the target's forward (its
    lean stack or its own modules, ``target.lean``), the drafter and its head."""
    weight = gen.target.get_input_embeddings().weight
    threads = torch.get_num_threads() if weight.device.type == "cpu" else 0
    lean = gen.lean and not gen.compile and lean_stack(gen.target) is not None
    return {**loaded_target_identity(gen.target), "device": weight.device.type, "dtype": str(weight.dtype),
            "threads": threads, "forward": "lean" if lean else "modules", "wrapper": type(gen.drafter).__name__, **chooser.identity, "longest": chooser.maximum}


def prepare_costs(gen: Any, batch: int, sampling: Sampling) -> None:
    """Give ``gen``'s cost-aware drafter the curve of ``batch`` rows in ``sampling``'s mode: kept, read from the
    cache, or measured and saved. Nothing for another drafter, an injected ``StepCosts``, a plan that drafts nothing
    at this batch size, or during a profile."""
    drafter = chooser_of(gen.drafter)
    if drafter is None or drafter.forced is not None or isinstance(drafter.costs, StepCosts):
        return
    if gen.plan is not None and gen.plan.length_for(batch) == 0:
        return  # no drafting at this batch size (infer.speculation_plan)
    key = cost_key(gen, drafter)
    if drafter.costs is None or drafter.costs.key != key:
        drafter.costs = load_costs(key)
    if drafter.costs.curve(batch, sampling.greedy) is None:
        drafter.costs.curves[curve_name(batch, sampling.greedy)] = measure_curve(gen, drafter, batch, sampling)
        drafter.costs.save()


def measure_curve(gen: Any, drafter: CostAwareLength, batch: int, sampling: Sampling) -> StepCosts:
    """Seconds per phase of a step drafting exactly k levels per row, per k (``drafter``: ``gen``'s chooser): in each
    of ``ROUNDS`` rounds every k decodes the fixed prompt, ``WARM_STEPS`` steps (k = 0: ``PLAIN_WARM_STEPS``), then
    the least of ``TIMED_STEPS`` steps is its time that round; the verify's t(k + 1) and the rest are the medians
    over the rounds, drafting a cost per step plus one per level through every round's (``per_level``); then a
    probe, timed alone. The k are interleaved round by round,
    so a burst of other work slows every k alike, not one of them. (The least over the rounds instead favours
    short steps on a busy machine: a 3.5 ms step fits in a scheduler slice, an 8 ms one is cut, so t(2)/t(1)
    read 2.3 where the medians read 1.0-1.5.)"""
    lengths = sorted({k for k in PROFILED if k < drafter.maximum} | {drafter.maximum})
    vocab = gen.target.get_input_embeddings().weight.shape[0]
    steps = ((WARM_STEPS + TIMED_STEPS) * (drafter.maximum + 1), PLAIN_WARM_STEPS + TIMED_STEPS, PROBE_IDLE + 1)
    budget = max(steps) + 2
    ids = torch.randint(0, vocab, (batch, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)).to(gen.device)
    rounds: dict[int, list[dict[str, float]]] = {k: [] for k in lengths}
    probes = []
    devices = [gen.device] if gen.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for _ in range(ROUNDS):
            for k in lengths:
                warm = WARM_STEPS if k else PLAIN_WARM_STEPS
                times = _timed_steps(gen, drafter, ids, budget, sampling, [k] * (warm + TIMED_STEPS), warm)
                rounds[k].append(min(times, key=lambda t: sum(t.values())))
            probe = _timed_steps(gen, drafter, ids, budget, sampling, [0] * PROBE_IDLE + [1], PROBE_IDLE)
            probes.append(sum(probe[0].values()))
    phases = {name: tuple(statistics.median(r[name] for r in rounds[k]) for k in lengths) for name in ("verify", "other")}
    draft = per_level([(k, r["draft"]) for k in lengths[1:] for r in rounds[k]])
    return StepCosts(tuple(lengths), tuple(0.0 if k == 0 else draft(k) for k in lengths), phases["verify"],
                     phases["other"], statistics.median(probes))


def per_level(samples: list[tuple[int, float]]):
    """Drafting k levels as a cost per step plus a cost per level (one head forward each): the least-squares line
    through every (k, seconds) sample with k >= 1, neither part below 0. One line from all the samples is steadier
    than a median per k on a busy machine."""
    ks, ys = [k for k, _ in samples], [y for _, y in samples]
    mk, my = statistics.fmean(ks), statistics.fmean(ys)
    spread = sum((k - mk) ** 2 for k in ks)
    slope = max(sum((k - mk) * (y - my) for k, y in samples) / spread, 0.0) if spread else 0.0
    base = max(my - slope * mk, 0.0)
    return lambda k: base + slope * k


def _timed_steps(gen: Any, drafter: CostAwareLength, ids: torch.Tensor, budget: int, sampling: Sampling,
                 levels: list[int], warm: int) -> list[dict[str, float]]:
    """One decode whose i-th step drafts ``levels[i]`` levels per row; per step after the first ``warm``: its
    drafting (the draft and observe phases), its verify and the rest, in seconds."""
    times = []
    drafter.forced = levels[0]  # a start with a forced length measures nothing (``prepare_costs``)
    try:
        dec = gen.start(ids, max_new_tokens=budget, temperature=sampling.temperature, top_k=sampling.top_k,
                        top_p=sampling.top_p, eos_token_id=[])
        clock = dec.instruments.clock = PhaseClock(gen.device, True)  # syncs at each phase's end
        clock.start()
        for i, k in enumerate(levels):
            drafter.forced = k
            before = dict(clock.times)
            sync(gen.device)
            start = clock.last = time.perf_counter()  # the draft phase starts with the step
            gen.step(dec)
            sync(gen.device)
            total = time.perf_counter() - start
            spent = {name: clock.times.get(name, 0.0) - before.get(name, 0.0) for name in clock.times}
            draft = spent.get("draft", 0.0) + spent.get("observe", 0.0)
            verify = spent.get("verify", 0.0)
            if i >= warm:
                times.append({"draft": draft, "verify": verify, "other": max(total - draft - verify, 0.0)})
    finally:
        drafter.forced = None
    return times
