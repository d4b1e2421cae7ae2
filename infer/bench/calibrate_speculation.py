"""Measure when speculation pays: tokens/s per (batch size, draft length) on this machine, and the
``SpeculationPlan`` that follows (per batch size the fastest length, 0 = plain decoding).

Every cell decodes the same left-padded prompts to exactly ``max_new_tokens`` (EOS ignored) with
the one generator, its plan pinned to that length; a length of 0 decodes without drafting (one token
per row per step, the generator's own loop), so "off" is measured, not assumed. The verify cost
t(B, N) and the head's acceptance enter through what they do to tokens/s; each cell also records τ
(tokens emitted per verify step, all rows together) and the tokens each verify carried, so the table
shows why a length won.
"""
from __future__ import annotations

from draftsmith.infer.bench.batch import left_pad
from draftsmith.infer.bench.timing import timed
from draftsmith.infer.speculation_plan import SpeculationPlan, choose_lengths
from draftsmith.data.base.progress import progress


def calibrate(generator, prompts: list[list[int]], batch_sizes: list[int], lengths: list[int], max_new_tokens: int,
              pad: int, warmup: int = 1, repeats: int = 1) -> SpeculationPlan:
    """Time ``generator`` on every (batch size, draft length); the plan picks the fastest length per size."""
    rows = []
    bar = progress(len(batch_sizes) * len(lengths), "calibration")
    kept = generator.plan
    try:
        for bsz in batch_sizes:
            ids, mask = left_pad([prompts[i % len(prompts)] for i in range(bsz)], pad, generator.device)
            for length in lengths:
                generator.plan = SpeculationPlan({1: length})  # this length at every batch size

                def run():
                    return generator.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=[])

                seconds, _ = timed(run, warmup, repeats)
                stats = generator.last_stats
                rows.append({"batch_size": bsz, "length": length, "tokens_per_s": stats.new_tokens / seconds,
                             "tau": stats.tau, "verified_per_step": stats.verified_tokens / max(1, stats.steps),
                             "seconds": seconds})
                bar.update()
                bar.set_postfix(batch=bsz, length=length, tok_s=f"{rows[-1]['tokens_per_s']:.0f}")
    finally:
        generator.plan = kept
        bar.close()
    return SpeculationPlan(choose_lengths(rows), rows)


def plan_markdown(plan: SpeculationPlan) -> str:
    """The measured table and the chosen length per batch size."""
    lines = ["| batch | draft length | tokens/s | τ (all rows) | verified tokens / step |", "|---:|---:|---:|---:|---:|"]
    for r in plan.measured:
        chosen = " **(chosen)**" if plan.lengths.get(r["batch_size"]) == r["length"] else ""
        lines.append(f"| {r['batch_size']} | {r['length']}{chosen} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                     f"{r['verified_per_step']:.1f} |")
    return "\n".join(lines) + "\n"
