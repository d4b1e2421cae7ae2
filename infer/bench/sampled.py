"""Sampled decoding in the benchmark (``draftsmith bench --temperatures 0,0.7,1``): at each temperature > 0, HF's
sampled ``generate`` (the baseline) and every method that runs ``SpeculativeGenerator``, on the same prompts,
each prompt under its own seed (``infer.seeded_decode``: every repeat and every method draws from the same
stream start). Per method: tokens/s (all new tokens over all seconds, each prompt's median over repeats), the
speedup over HF's sampled generate, τ pooled over the prompts with its 95% interval, and vLLM's acceptance names
(counts summed over the prompts first). A sampled decode is lossless in law, not token for token: no
``identical`` column here."""
from __future__ import annotations

import statistics
import time

import torch

from draftsmith.data.base.device import sync
from draftsmith.infer.bench.methods import Method
from draftsmith.infer.seeded_decode import prompt_seed, seeded_generate, tau_report


def _median_seconds(run, repeats: int, warmup: int, device) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for rep in range(warmup + repeats):
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = run()
        sync(device)
        if rep >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _hf_sampled(target, ids, args, temperature: float, pad: int | None):
    torch.manual_seed(prompt_seed(ids))
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                           top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens, pad_token_id=pad)


def _measure_step_costs(gen, ids, options: dict) -> None:
    """One untimed decode of one token: a drafter that chooses its draft lengths by step costs (the CPU default
    chain at T > 0, ``infer.cost_profile``) measures them on its first decode in a sampling mode, once per key, and
    without this the first timed decode (``--warmup 0``) would count that measurement as decoding time."""
    seeded_generate(gen, ids, **{**options, "max_new_tokens": 1})


def time_sampled(methods: list[Method], prompts, args, target, pad: int | None) -> list[dict]:
    """One row per (temperature > 0, method): HF's sampled generate first, then each generator method."""
    device, rows = target.device, []
    ours = [m for m in methods if m.generator is not None]
    for temperature in [t for t in args.temperatures if t > 0]:
        options = dict(max_new_tokens=args.max_new_tokens, temperature=temperature, top_p=args.top_p,
                       top_k=args.top_k)
        new = seconds = 0.0
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            took, out = _median_seconds(lambda: _hf_sampled(target, ids, args, temperature, pad), args.repeats,
                                        args.warmup, device)
            new, seconds = new + out.shape[1] - ids.shape[1], seconds + took
        baseline = new / seconds
        rows.append({"method": "hf-sampled", "temperature": temperature, "tokens_per_s": baseline, "speedup": 1.0})
        for m in ours:
            _measure_step_costs(m.generator, torch.tensor([prompts[0]], device=device), options)
            stats, new, seconds = [], 0, 0.0
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)
                took, out = _median_seconds(lambda: seeded_generate(m.generator, ids, **options), args.repeats,
                                            args.warmup, device)
                stats.append(m.generator.last_stats)
                new, seconds = new + out.shape[1] - ids.shape[1], seconds + took
            report = tau_report(stats)
            rows.append({"method": m.name, "temperature": temperature, **report, "tokens_per_s": new / seconds,
                         "speedup": new / seconds / baseline})
    return rows


def sampled_markdown(rows: list[dict] | None) -> str:
    """The sampled table of results.md ("" when no temperature > 0 was asked for)."""
    if not rows:
        return ""
    lines = ["", "Sampled decoding (each prompt under its own seed; τ with its 95% interval over the prompts; "
             "mean acceptance length and per-position acceptance as vLLM reports them, from summed counts):", "",
             "| T | method | tokens/s | speedup vs hf-sampled | τ | τ 95% | mean acceptance length | per-position acceptance |",
             "|---:|---|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if "tau" not in r:
            lines.append(f"| {r['temperature']:g} | {r['method']} | {r['tokens_per_s']:.1f} | 1.00× | – | – | – | – |")
            continue
        ci = "–" if r["tau_low"] is None else f"{r['tau_low']:.2f}–{r['tau_high']:.2f}"
        per_pos = " ".join(f"{a:.2f}" for a in r["acceptance_rate_per_pos"][:6])
        lines.append(f"| {r['temperature']:g} | {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                     f"{r['tau']:.2f} | {ci} | {r['mean_acceptance_length']:.2f} | {per_pos} |")
    return "\n".join(lines) + "\n"
