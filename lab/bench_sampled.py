"""Sampled decoding's speed against the target's own (issue 56, docs/benchmarks.md), in one process.

    python lab/bench_sampled.py --head runs/demo-s0/best [--prompt "class Queue:" | --held-out 24]
        [--temperatures 0,0.7,1] [--rounds 12] [--max-new-tokens 64] [--threads 1] [--out FILE.json]

Per temperature, each round decodes the prompt once with every method in turn (a load change on a shared
machine hits them alike), no EOS, from the same seed: the target's own ``generate`` ("hf"), the generator's
default drafter ("default"), the generator with a plan of no drafting ("plain": its own plain step) and a chain
of one draft ("chain1"), the first two also on the target's own modules instead of its lean stack
("default-modules", "plain-modules": ``SpeculativeGenerator(lean=False)``, the decoder before
``target.lean_forward``). ``--held-out N``: round r decodes held-out prompt r mod N (64 tokens of
``data.corpus.continuation_prompts``) instead of ``--prompt``. Time is the thread's CPU time
(``time.thread_time``: another process's bursts on a busy box slow it less than the wall clock). Per method: the
least seconds per token over the rounds, its speed over hf's least, each round's speed over hf's that round
(median and range), and the total tokens over the total seconds against hf's ("speed_over_hf_total").
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draftsmith.heads import AutoHead
from draftsmith.infer.drafters import Chain
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.speculation_plan import SpeculationPlan


def methods(gen: SpeculativeGenerator) -> dict[str, SpeculativeGenerator | None]:
    """The decoders compared: None is the target's own ``generate``."""
    target, head, tok = gen.target, gen.head, gen.tokenizer
    plain = SpeculationPlan({1: 0})
    return {"hf": None, "default": gen, "default-modules": SpeculativeGenerator(target, head, tok, lean=False),
            "plain": SpeculativeGenerator(target, head, tok, tree=Chain(1), plan=plain),
            "plain-modules": SpeculativeGenerator(target, head, tok, tree=Chain(1), plan=plain, lean=False),
            "chain1": SpeculativeGenerator(target, head, tok, tree=Chain(1))}


def decode_seconds(gen: SpeculativeGenerator | None, target, ids: torch.Tensor, n: int, temperature: float,
                   seed: int) -> float:
    """CPU seconds of one decode of ``n`` new tokens (no EOS) from ``seed``."""
    torch.manual_seed(seed)
    start = time.thread_time()
    if gen is not None:
        gen.generate(ids, max_new_tokens=n, temperature=temperature, eos_token_id=[])
        if gen.last_stats.new_tokens != n:
            raise RuntimeError(f"a decode emitted {gen.last_stats.new_tokens} tokens, not {n}")
        return time.thread_time() - start
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
        {"do_sample": False}
    with torch.inference_mode():  # an EOS id past the vocabulary: HF decodes all n tokens
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, pad_token_id=0,
                               eos_token_id=target.config.vocab_size, **sample)
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError(f"HF's decode emitted {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return time.thread_time() - start


def measure(gen: SpeculativeGenerator, prompts: list[torch.Tensor], temperatures: list[float], rounds: int,
            n: int) -> dict:
    """Per temperature and method: least seconds per token, speed over hf's least, per-round speeds over hf's,
    total tokens over total seconds against hf's. Round r decodes ``prompts[r % len(prompts)]``."""
    decoders = methods(gen)
    report = {}
    for temperature in temperatures:
        for d in decoders.values():  # warm-up: first-call allocations, a chooser's step-cost profile
            decode_seconds(d, gen.target, prompts[0], 4, temperature, 0)
        seconds = {name: [] for name in decoders}
        for r in range(rounds):
            for name, d in decoders.items():
                seconds[name].append(decode_seconds(d, gen.target, prompts[r % len(prompts)], n, temperature, r))
        hf = seconds["hf"]
        rows = {}
        for name, s in seconds.items():
            ratios = sorted(h / x for h, x in zip(hf, s))
            rows[name] = {"ms_per_token_least": 1e3 * min(s) / n, "speed_over_hf_least": min(hf) / min(s),
                          "speed_over_hf_median": statistics.median(ratios), "range": [ratios[0], ratios[-1]],
                          "speed_over_hf_total": sum(hf) / sum(s)}
        report[str(temperature)] = rows
    return report


def load_average() -> list[str] | None:
    """The 1, 5 and 15 minute load averages as /proc/loadavg says them (None where there is none)."""
    path = Path("/proc/loadavg")
    return path.read_text().split()[:3] if path.is_file() else None


def emit(report: dict, out: str | None) -> None:
    """Print ``report`` as JSON and write it to ``out`` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True)
    p.add_argument("--prompt", default="class Queue:")
    p.add_argument("--held-out", type=int, default=0, help="decode this many held-out prompts instead, in turn")
    p.add_argument("--temperatures", default="0,0.7,1")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args(argv)
    head = AutoHead.from_pretrained(args.head)
    gen = SpeculativeGenerator.from_pretrained(head.config.target_name_or_path, head, device="cpu", threads=args.threads)
    if args.held_out:
        from draftsmith.data.corpus import continuation_prompts

        prompts = [torch.tensor([p]) for p in continuation_prompts(gen.tokenizer, args.held_out, 64, args.max_new_tokens)]
    else:
        prompts = [gen.tokenizer(args.prompt, return_tensors="pt")["input_ids"]]
    report = {"head": args.head, "prompt": f"{args.held_out} held-out" if args.held_out else args.prompt,
              "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "load_before": load_average(),
              "temperatures": measure(gen, prompts, [float(t) for t in args.temperatures.split(",")], args.rounds,
                                      args.max_new_tokens)}
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
