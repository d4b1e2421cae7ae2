"""The verification cost t(N), and what it bounds.

A verification forward over N tokens costs t(N) on this hardware; a method with acceptance tau
verifying N tokens per step can at best be tau*t(1)/t(N) times faster than one forward per token
(drafting for free). Measured t(N) is noisy on a shared machine and can dip below a smaller N's;
the bound reads the monotone envelope t*(N) = max over n <= N of t(n), so it never credits a method
with a verify cheaper than a smaller one (which would push efficiency over 100%).
"""
from __future__ import annotations

import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import DynamicCache

from draftsmith.data.base.device import sync
from draftsmith.infer.cache import crop_dynamic
from draftsmith.infer.bench.oracle import OracleDrafter
from draftsmith.infer.drafters import Draft
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.target.model import target_forward
from draftsmith.infer.tree import chain_parents, tree_attention_mask, tree_from_parents


def verify_costs(sizes: list[int], prompt: torch.Tensor, generators: dict[int, SpeculativeGenerator],
                 max_new_tokens: int, repeats: int) -> dict[int, float]:
    """Median seconds of one compiled static verify over N tokens after the prompt, per N; sizes
    interleaved round-robin. Uses each N's generator (its compiled step and its cache)."""
    states = {}
    for n in sizes:
        gen = generators[n]
        with torch.inference_mode():
            cache = gen.prefill(prompt, max_new_tokens).past_key_values  # the prompt in gen's static cache
        draft = Draft(prompt[0, -1:].expand(n).clone(), tree_from_parents(chain_parents(n - 1), prompt.device))
        states[n] = (gen, cache, draft)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        for rep in range(repeats + 3):  # 3 warm-up rounds (compile, CUDA-graph recording)
            for n in sizes:
                gen, cache, draft = states[n]
                sync()
                start = time.perf_counter()
                gen.verify(cache, draft)  # the same prefix every time: slots are overwritten
                sync()
                if rep >= 3:
                    times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def dynamic_verify_costs(target, prompt: list[int], sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one target forward over an N-token tree after a cached prompt, per N.

    Sizes are interleaved within each repeat (round robin), so a slow spell of a shared machine
    hits every N alike instead of bending the curve.
    """
    device = target.device
    cache = DynamicCache()
    ids = torch.tensor([prompt], device=device)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        target_forward(target, ids, past_key_values=cache, use_cache=True, compute_logits=False)
        prefix = ids.shape[1]
        inputs = {}
        for n in sizes:
            # a bushy tree (root + children under the first few nodes); cost depends on N, not shape
            tree = tree_from_parents([-1] + [(i - 1) // 4 for i in range(1, n)], device)
            inputs[n] = dict(attention_mask=tree_attention_mask(tree.mask, prefix, target.dtype),
                             position_ids=(prefix + tree.depths)[None],
                             tokens=torch.tensor([prompt[-1]] * n, device=device)[None])
        for rep in tqdm(range(repeats + 1), desc="verification cost t(N)", unit="round"):
            for n in sizes:
                x = inputs[n]
                sync(device)
                start = time.perf_counter()
                target_forward(target, x["tokens"], attention_mask=x["attention_mask"],
                               position_ids=x["position_ids"], past_key_values=cache, use_cache=True)
                sync(device)
                if rep:  # the first round is warm-up
                    times[n].append(time.perf_counter() - start)
                crop_dynamic(cache, prefix)
    return {n: statistics.median(times[n]) for n in sizes}



def monotone(costs: dict[int, float]) -> dict[int, float]:
    """The running maximum of t(N) over increasing N."""
    out, best = {}, 0.0
    for n in sorted(costs):
        best = max(best, costs[n])
        out[n] = best
    return out


def cost_at(costs: dict[int, float], n: float) -> float:
    """t*(n): the monotone envelope of the measured sweep, linearly interpolated (and extrapolated
    linearly in n past the largest N measured)."""
    env = monotone(costs)
    sizes = sorted(env)
    if n <= sizes[0]:
        return env[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if n <= hi:
            return env[lo] + (env[hi] - env[lo]) * (n - lo) / (hi - lo)
    return env[sizes[-1]] * n / sizes[-1]


def bound(tau: float, costs: dict[int, float], n_verify: float) -> float:
    """tau*t(1)/t*(N): the most a method verifying ``n_verify`` tokens per step with acceptance
    ``tau`` can gain over one forward per token."""
    return tau * costs[min(costs)] / cost_at(costs, n_verify)


def static_verify_costs(target, prompt: list[int], sizes: list[int], args, compile: bool) -> dict[int, float]:
    """t(N) of the static (compiled when ``compile``) verify step, per N, interleaved."""
    ids = torch.tensor([prompt], device=target.device)
    vocab = target.config.get_text_config().vocab_size
    gens = {n: SpeculativeGenerator(target, OracleDrafter(ids[0], len(prompt), n - 1, vocab),
                                    compile=compile) for n in sizes}
    return verify_costs(sizes, ids, gens, args.max_new_tokens, repeats=max(30, 10 * args.repeats))


def step_costs(target, prompt: list[int], sizes: list[int], args, generators: list[SpeculativeGenerator]) -> dict[int, float]:
    """t(N) of the verify step the generators really run (compiled or not, as the first one), or of an
    eager forward over a DynamicCache (HF's decode state) when only HF's methods run."""
    if generators:
        return static_verify_costs(target, prompt, sizes, args, generators[0].compile)
    return dynamic_verify_costs(target, prompt, sizes, repeats=max(30, 10 * args.repeats))
