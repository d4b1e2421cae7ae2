"""Several heads of one target decoding the same held-out prompts with the generator's default drafter, interleaved
(a recipe's τ gain is not a speed gain until its tokens/s say so; docs/objectives.md).

    python lab/bench_heads.py HEAD_DIR [HEAD_DIR ...] [--prompts 24] [--temperatures 0,1] [--rounds 3]
        [--max-new-tokens 128] [--threads 1] [--out FILE.json]

Each round decodes every prompt (32 tokens of ``data.corpus.continuation_prompts``, the real-τ prompts of
``draftsmith rank-heads``) at every temperature with the target's own ``generate`` ("hf", greedy or sampled) and then
each head in turn, prompt by prompt (a load change on a shared machine hits them alike), no EOS, prompt i under
seed i. Time is the thread's CPU time. Per temperature and head: τ (tokens per verify step), tokens/s over all
rounds, and the speed over hf's.
"""
from __future__ import annotations

import argparse

import torch

from draftsmith.data.base.checks import cli_count, cli_temperatures
from draftsmith.heads import AutoHead
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.lab.bench_sampled import decode_seconds, emit, load_average


def measure(target, gens: dict[str, SpeculativeGenerator], prompts: list[torch.Tensor], temperatures: list[float],
            rounds: int, n: int) -> dict:
    """Per temperature and method ("hf" and each head): seconds, tokens, steps and step tokens over ``rounds``."""
    methods = {"hf": None, **gens}
    totals = {t: {m: [0.0, 0, 0, 0] for m in methods} for t in temperatures}
    for r in range(rounds + 1):  # round 0 warms up (and profiles each chooser's step costs)
        for t in temperatures:
            for i, ids in enumerate(prompts):
                for name, gen in methods.items():
                    seconds = decode_seconds(gen, target, ids, n, t, seed=i)
                    if r:
                        total = totals[t][name]
                        total[0] += seconds
                        total[1] += n
                        if gen is not None:
                            total[2] += gen.last_stats.steps
                            total[3] += gen.last_stats.step_tokens
        print(f"round {r}/{rounds} done", flush=True)
    return totals


def summary(totals: dict) -> dict:
    report = {}
    for t, per in totals.items():
        hf = per["hf"][1] / per["hf"][0]
        report[f"{t:g}"] = {m: {"tokens_per_s": v[1] / v[0], "speed_over_hf": v[1] / v[0] / hf,
                                **({"tau": v[3] / v[2]} if v[2] else {})} for m, v in per.items()}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("heads", nargs="+")
    p.add_argument("--prompts", type=cli_count(), default=24)
    p.add_argument("--temperatures", type=cli_temperatures, default=[0.0, 1.0])
    p.add_argument("--rounds", type=cli_count(), default=3)
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--threads", type=cli_count(), default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from draftsmith.data.corpus import continuation_prompts

    heads = {name: AutoHead.from_pretrained(name).eval() for name in args.heads}
    targets = {h.config.target_name_or_path for h in heads.values()}
    if len(targets) != 1:
        raise SystemExit(f"the heads were trained for different targets: {sorted(targets)}")
    first = SpeculativeGenerator.from_pretrained(targets.pop(), heads[args.heads[0]], device="cpu", threads=args.threads)
    target, tok = first.target, first.tokenizer
    prompts = [torch.tensor(q)[None] for q in continuation_prompts(tok, args.prompts, 32, args.max_new_tokens)]
    gens = {name: SpeculativeGenerator(target, head, tok) for name, head in heads.items()}
    started = load_average()
    with torch.inference_mode():
        totals = measure(target, gens, prompts, args.temperatures, args.rounds, args.max_new_tokens)
    report = {"command": "python lab/bench_heads.py " + " ".join(argv or []), "load_average_start": started,
              "load_average_end": load_average(), "rounds": args.rounds, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "temperatures": summary(totals)}
    for t, rows in report["temperatures"].items():
        print(f"T={t}: " + " | ".join(f"{m} {v['tokens_per_s']:.0f} tok/s ({v['speed_over_hf']:.3f}x hf"
                                      + (f", τ {v['tau']:.2f})" if "tau" in v else ")") for m, v in rows.items()))
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
