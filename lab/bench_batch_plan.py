"""The generator's default drafter against every fixed draft length, per batch size (issue 56, docs/benchmarks.md).

    python lab/bench_batch_plan.py --head runs/demo-s0/best [--batch-sizes 1,4,16] [--lengths 0,1,2,3,4,6,8]
        [--prompts 16] [--rounds 3] [--max-new-tokens 64] [--temperature 0] [--threads 1] [--out FILE.json]

What ``draftsmith speculation-plan`` measures (each batch size's rows decoding to exactly ``--max-new-tokens``, EOS
ignored, one generator whose plan pins each length, 0 = plain decoding), with the default drafter beside it
(``SpeculativeGenerator(target, head)``: no plan, the kind's default policy) and the adaptive and cost-aware chains
alone, every method decoded in turn in each round (a load change on a shared machine hits them alike). Every batch size decodes the same ``--prompts``
held-out prompts (64 tokens of ``data.corpus.continuation_prompts``), ``--prompts / B`` batches of B rows
(left-padded). Time is the thread's CPU time. Per batch size and method: tokens/s (all rounds' tokens over all
rounds' seconds), τ per row, and the default's speed over the best fixed length's.
"""
from __future__ import annotations

import argparse
import time

import torch

from draftsmith.data.base.checks import cli_count, cli_counts, cli_real
from draftsmith.heads import AutoHead
from draftsmith.infer.bench.batch import left_pad
from draftsmith.infer.drafters import Chain, adaptive_chain, chosen_chain
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.speculation_plan import SpeculationPlan
from draftsmith.lab.bench_sampled import emit, load_average


def decoders(target, head, tokenizer, lengths: list[int]) -> dict[str, tuple[SpeculativeGenerator, SpeculationPlan | None]]:
    """"default" (no plan, the default drafter), "adaptive" (the adaptive chain, the CPU default for batches before
    issue 56's batch change), "chosen" (the cost-aware chain, ``chosen_chain``) and "L<n>" for each fixed length (a
    chain pinned by a plan)."""
    fixed = SpeculativeGenerator(target, head, tokenizer, tree=Chain(max(1, max(lengths))))
    out = {"default": (SpeculativeGenerator(target, head, tokenizer), None),
           "adaptive": (SpeculativeGenerator(target, adaptive_chain(head, target), tokenizer), None),
           "chosen": (SpeculativeGenerator(target, chosen_chain(head, target), tokenizer), None)}
    out.update({f"L{n}": (fixed, SpeculationPlan({1: n})) for n in lengths})
    return out


def measure(methods: dict, batches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], rounds: int, n: int,
            temperature: float) -> dict:
    """Per batch size and method: summed seconds, tokens, verify steps and emitted step tokens (all rows) over
    ``rounds``, each round every batch of that size (together, every prompt once)."""
    totals = {b: {m: [0.0, 0, 0, 0] for m in methods} for b in batches}
    for r in range(rounds + 1):  # round 0 warms every decoder up (and profiles the chooser's step costs)
        for b, chunks in batches.items():
            for name, (gen, plan) in methods.items():
                gen.plan = plan
                for ids, mask in chunks:
                    torch.manual_seed(r)
                    start = time.thread_time()
                    gen.generate(ids, attention_mask=mask, max_new_tokens=n, temperature=temperature,
                                 eos_token_id=[])
                    seconds = time.thread_time() - start
                    stats = gen.last_stats
                    if stats.new_tokens != n * b:
                        raise RuntimeError(f"{name} at batch {b} emitted {stats.new_tokens} tokens, not {n * b}")
                    if r:
                        t = totals[b][name]
                        t[0] += seconds
                        t[1] += stats.new_tokens
                        t[2] += stats.steps
                        t[3] += stats.step_tokens
        print(f"round {r}/{rounds} done", flush=True)
    return totals


def summary(totals: dict) -> dict:
    report = {}
    for b, per in totals.items():
        rows = {m: {"tokens_per_s": t[1] / t[0], "tau_per_row": t[3] / max(1, t[2]) / b} for m, t in per.items()}
        fixed = {m: r for m, r in rows.items() if m.startswith("L")}
        best = max(fixed, key=lambda m: fixed[m]["tokens_per_s"])
        report[str(b)] = {"methods": rows, "best_fixed": best,
                          "default_over_best_fixed": rows["default"]["tokens_per_s"] / fixed[best]["tokens_per_s"]}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True)
    p.add_argument("--batch-sizes", type=cli_counts(), default="1,4,16")
    p.add_argument("--lengths", type=cli_counts(0), default="0,1,2,3,4,6,8")
    p.add_argument("--prompts", type=cli_count(), default=16, help="held-out prompts, every batch size decodes them all")
    p.add_argument("--rounds", type=cli_count(), default=3)
    p.add_argument("--max-new-tokens", type=cli_count(), default=64)
    p.add_argument("--temperature", type=cli_real(0), default=0.0)
    p.add_argument("--threads", type=cli_count(), default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from draftsmith.data.corpus import continuation_prompts

    head = AutoHead.from_pretrained(args.head).eval()
    gen = SpeculativeGenerator.from_pretrained(head.config.target_name_or_path, head, device="cpu", threads=args.threads)
    target, tok = gen.target, gen.tokenizer
    prompts = continuation_prompts(tok, args.prompts, 64, args.max_new_tokens)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for b in args.batch_sizes:
        if args.prompts % b:
            raise SystemExit(f"--prompts {args.prompts} is no multiple of batch size {b}")
    batches = {b: [left_pad(prompts[i: i + b], pad, torch.device("cpu")) for i in range(0, args.prompts, b)]
               for b in args.batch_sizes}
    started = load_average()
    with torch.inference_mode():
        totals = measure(decoders(target, head, tok, args.lengths), batches, args.rounds, args.max_new_tokens,
                         args.temperature)
    report = {"command": "python lab/bench_batch_plan.py " + " ".join(argv or []), "load_average_start": started,
              "load_average_end": load_average(), "temperature": args.temperature, "rounds": args.rounds,
              "max_new_tokens": args.max_new_tokens, "batch_sizes": summary(totals)}
    for b, r in report["batch_sizes"].items():
        cells = " | ".join(f"{m} {v['tokens_per_s']:.0f} (τ {v['tau_per_row']:.2f})" for m, v in r["methods"].items())
        print(f"batch {b}: {cells} | best fixed {r['best_fixed']} | default / best fixed "
              f"{r['default_over_best_fixed']:.3f}", flush=True)
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
