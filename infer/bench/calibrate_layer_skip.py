"""Layer-skip calibration: which ``k`` (the target's first k layers drafting) decodes fastest here.

For every k the same held-out prompts are decoded greedily (k interleaved per prompt, so a slow spell
of a shared machine hits every k alike) with a profiled generator, which gives per k: the acceptance
τ (tokens per target forward), the seconds per step spent drafting (k layers, ``depth`` times) and
verifying (the full target over depth + 1 tokens), and the tokens per second they add up to. τ / (step
seconds) is the expected tokens per unit time; the k with the most wins. Plain greedy decoding
(``target.generate``) runs on the same prompts, interleaved alike, so the table says whether any k
beats decoding without a draft on this machine.
"""
from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from draftsmith.data.base.device import sync

from draftsmith.infer.drafters import Chain
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter


def calibrate_layer_skip(target, prompts: list[list[int]], layers: list[int], depth: int,
                         max_new_tokens: int) -> dict:
    """``{"best_layers": k, "depth": depth, "vanilla_tokens_per_s": ..., "rows": [{layers, tau, draft_s_per_step,
    verify_s_per_step, tokens_per_s}, ...]}`` from greedy decoding of ``prompts`` with every k in ``layers``
    (no EOS: every prompt decodes ``max_new_tokens``)."""
    gens = {k: SpeculativeGenerator(target, LayerSkipDrafter(target, k, Chain(depth)), profile=True, compile=False)
            for k in layers}
    totals = {k: {"tokens": 0, "forwards": 0, "steps": 0, "draft": 0.0, "verify": 0.0, "wall": 0.0} for k in layers}
    device = target.get_input_embeddings().weight.device
    warm = torch.tensor([prompts[0][:8]], device=device)
    for gen in gens.values():  # first-call allocations are not decoding speed
        gen.generate(warm, max_new_tokens=4, eos_token_id=[])
    vanilla = [0, 0.0]  # tokens, seconds
    plain = dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
    for prompt in tqdm(prompts, desc="layer-skip calibration", unit="prompt"):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            sync(device)
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), **plain)
            sync(device)  # sync: time the finished decode
            vanilla[0] += out.shape[1] - ids.shape[1]
            vanilla[1] += time.perf_counter() - start
        for k, gen in gens.items():
            gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[])
            s, t = gen.last_stats, totals[k]
            t["tokens"] += s.new_tokens
            t["forwards"] += s.target_forwards
            t["steps"] += s.steps
            t["draft"] += s.phase_times.get("draft", 0.0)
            t["verify"] += s.phase_times.get("verify", 0.0)
            t["wall"] += s.wall_time
    rows = [{"layers": k, "tau": t["tokens"] / t["forwards"], "draft_s_per_step": t["draft"] / t["steps"],
             "verify_s_per_step": t["verify"] / t["steps"], "tokens_per_s": t["tokens"] / t["wall"]}
            for k, t in totals.items()]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {"best_layers": best["layers"], "depth": depth, "max_new_tokens": max_new_tokens,
            "num_prompts": len(prompts), "vanilla_tokens_per_s": vanilla[0] / vanilla[1], "rows": rows}


def calibration_markdown(result: dict) -> str:
    """The rows as a table, the chosen k marked, plain decoding first."""
    lines = ["| k | τ | draft ms/step | verify ms/step | tokens/s |", "|---|---|---|---|---|",
             f"| none (target.generate) | 1.00 | – | – | {result['vanilla_tokens_per_s']:.1f} |"]
    for r in result["rows"]:
        mark = " **(chosen)**" if r["layers"] == result["best_layers"] else ""
        lines.append(f"| {r['layers']}{mark} | {r['tau']:.2f} | {1e3 * r['draft_s_per_step']:.2f} | "
                     f"{1e3 * r['verify_s_per_step']:.2f} | {r['tokens_per_s']:.1f} |")
    return "\n".join(lines)
