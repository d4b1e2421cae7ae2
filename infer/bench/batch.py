"""Batch speculation against HF's batched ``generate(cache_implementation="static")``: per batch
size B, the first B prompts (cycled when there are fewer) left-padded into one batch, every
speculative method with an eager generator (a batch decodes eager) on it, tokens/s over all rows."""
from __future__ import annotations

import torch

from draftsmith.data.base.device import sync
from draftsmith.infer.bench.timing import timed


def left_pad(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) (B, P) of ``prompts`` padded on the left with ``pad``."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def row_tokens(new: torch.Tensor, eos: list[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS (the rest is padding)."""
    rows = []
    for row in new.tolist():
        hit = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row if hit is None else row[: hit + 1])
    return rows


def time_batches(methods, prompts: list[list[int]], batch_sizes: list[int], args, target, tokenizer) -> list[dict]:
    """One row per (batch size, method): tokens/s over the batch's rows, speedup over HF's batched
    static-cache generate, and whether every row's greedy output equals HF's."""
    device = target.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad = 0 if pad is None else pad
    eos_config = getattr(target.generation_config, "eos_token_id", None)
    eos = [] if args.ignore_eos or eos_config is None else [eos_config] if isinstance(eos_config, int) else list(eos_config)
    ours = [m for m in methods if m.generator is not None and not m.generator.compile]
    rows = []
    for bsz in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(bsz)]
        ids, mask = left_pad(batch, pad, device)

        def hf():
            return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens,
                                   pad_token_id=pad, eos_token_id=eos or None, cache_implementation="static")

        runs = [("hf-static", hf)] + [
            (m.name, (lambda g: lambda: g.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                                   eos_token_id=eos, pad_token_id=pad))(m.generator))
            for m in ours
        ]
        reference = None
        for name, run in runs:
            with torch.inference_mode():
                seconds, out = timed(run, args.warmup, args.repeats)
            sync(device)
            tokens = row_tokens(out[:, ids.shape[1]:], eos)
            reference = tokens if reference is None else reference
            count = sum(map(len, tokens))
            rows.append({"batch_size": bsz, "method": name, "new_tokens": count, "seconds": seconds,
                         "tokens_per_s": count / seconds, "identical": tokens == reference})
        base = rows[-len(runs)]["tokens_per_s"]
        for row in rows[-len(runs):]:
            row["speedup_vs_hf_static"] = row["tokens_per_s"] / base
    return rows


def batch_markdown(rows: list[dict] | None) -> str:
    """The batch table ("" without ``--batch-sizes``)."""
    if not rows:
        return ""
    lines = ["", "## Batches (left-padded, greedy)", "",
             "| batch | method | new tokens | tokens/s | vs hf-static | identical |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['new_tokens']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_hf_static']:.2f}x | {'yes' if r['identical'] else 'NO'} |")
    lines.append("")
    lines.append("tokens/s: every row's new tokens (to its EOS) over the batch's median seconds; identical: every "
                 "row equals HF's batched static-cache generate.")
    return "\n".join(lines) + "\n"
