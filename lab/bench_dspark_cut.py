"""DSpark's confidence cut against verifying every draft (issue 56, docs/benchmarks.md), in one process.

    python lab/bench_dspark_cut.py --head runs/demo-dspark/best [--held-out 24] [--temperatures 0,1]
        [--max-new-tokens 128] [--threads 1] [--out FILE.json]

Round r decodes held-out prompt r (64 tokens of ``data.corpus.continuation_prompts``) with every method in turn, no
EOS, from the same seed: "every" (the kind's CPU chain verifying every draft: ``confidence=0``), "threshold" (the
default: DSpark's adaptive verification at 0.5), "chooser" (``chosen_chain``: the cost-aware chooser, DSpark cutting
each row's block by its confidences under the chooser's measured step costs) and "chooser-every" (the same chooser,
every drafted slot verified). Time is the thread's CPU time; per method: total tokens over total seconds, its speed
over "every", the pooled τ, and each round's speed over "every" (median and range).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.heads import AutoHead
from draftsmith.infer.drafters import Chain, CostAwareLength, chosen_chain, make_drafter
from draftsmith.infer.drafters.dflash import DFlashDrafter
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.lab.bench_sampled import emit, load_average


def methods(target, head) -> dict[str, SpeculativeGenerator]:
    chain = DFlashDrafter.longest_chain(head)
    return {"every": SpeculativeGenerator(target, make_drafter(head, target, confidence=0.0)),
            "threshold": SpeculativeGenerator(target, make_drafter(head, target)),
            "chooser": SpeculativeGenerator(target, chosen_chain(head, target)),
            "chooser-every": SpeculativeGenerator(target, CostAwareLength(
                make_drafter(head, target, Chain(chain), confidence=0.0), maximum=chain))}


def measure(target, head, prompts: list[torch.Tensor], temperatures: list[float], n: int) -> dict:
    decoders = methods(target, head)
    report = {}
    for temperature in temperatures:
        for gen in decoders.values():  # warm-up: allocations, the chooser's step-cost profile
            gen.generate(prompts[0], max_new_tokens=4, temperature=temperature, eos_token_id=[])
        seconds = {k: [] for k in decoders}
        steps = {k: [0, 0] for k in decoders}
        for r, ids in enumerate(prompts):
            for name, gen in decoders.items():
                torch.manual_seed(r)
                start = time.thread_time()
                gen.generate(ids, max_new_tokens=n, temperature=temperature, eos_token_id=[])
                seconds[name].append(time.thread_time() - start)
                steps[name][0] += gen.last_stats.step_tokens
                steps[name][1] += gen.last_stats.steps
        every = seconds["every"]
        rows = {}
        for name, s in seconds.items():
            ratios = sorted(e / x for e, x in zip(every, s))
            rows[name] = {"tokens_per_s": n * len(s) / sum(s), "speed_over_every": sum(every) / sum(s),
                          "median_over_every": statistics.median(ratios), "range": [ratios[0], ratios[-1]],
                          "tau": steps[name][0] / steps[name][1]}
        report[str(temperature)] = rows
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True)
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from draftsmith.data.corpus import continuation_prompts

    head = AutoHead.from_pretrained(args.head)
    gen = SpeculativeGenerator.from_pretrained(head.config.target_name_or_path, head, device="cpu", threads=args.threads)
    prompts = [torch.tensor([q]) for q in continuation_prompts(gen.tokenizer, args.held_out, 64, args.max_new_tokens)]
    report = {"head": args.head, "prompts": args.held_out, "max_new_tokens": args.max_new_tokens,
              "load_before": load_average(),
              "temperatures": measure(gen.target, gen.head, prompts, [float(t) for t in args.temperatures.split(",")],
                                      args.max_new_tokens)}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
