"""When to speculate, per batch size: measure tokens/s for each draft length and write the plan the
generator follows by default.

    draftsmith speculation-plan --target DIR --head HEAD_DIR [--batch-sizes 1,2,4,8]
        [--lengths 0,1,2,3,4] [--num-prompts 8] [--prompt-tokens 128] [--max-new-tokens 64]
        [--repeats 1] [--threads N] [--out PATH]

The head drafts chains (``Chain(max(--lengths))``, capped per cell); length 0 is plain decoding.
Writes ``speculation_plan.json`` into the head's directory (or ``--out``; an earlier plan there is
replaced, nothing else is touched), where
``SpeculativeGenerator.from_pretrained(target, HEAD_DIR)`` picks it up; prints the measured table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_counts
from draftsmith.data.base.paths import claim_report_file, json_with_keys
from draftsmith.data.entry_point import prog
from draftsmith.infer.bench.prompts import load_prompts
from draftsmith.infer.speculation_plan import PLAN_FILE


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog=prog("speculation_plan.py"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory, hub id, demo:<size> or demo:smollm2")
    p.add_argument("--head", required=True, help="trained head directory")
    p.add_argument("--batch-sizes", type=cli_counts(), default="1,2,4,8")
    p.add_argument("--lengths", type=cli_counts(0), default="0,1,2,3,4", help="draft lengths to try (0 = no drafting)")
    p.add_argument("--prompts", help="JSONL with {'prompt': str} or {'messages': [...]} rows, or demo:mtbench")
    p.add_argument("--num-prompts", type=cli_count(), default=8)
    p.add_argument("--prompt-tokens", type=cli_count(), default=128)
    p.add_argument("--max-new-tokens", type=cli_count(), default=64)
    p.add_argument("--warmup", type=cli_count(0), default=1)
    p.add_argument("--repeats", type=cli_count(), default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=cli_count(), default=None)
    p.add_argument("--out", default=None, help=f"where to write the plan (default HEAD_DIR/{PLAN_FILE})")
    args = p.parse_args(argv)
    batch_sizes, lengths = sorted(set(args.batch_sizes)), sorted(set(args.lengths))
    out = claim_report_file(Path(args.out) if args.out else Path(args.head) / PLAN_FILE, json_with_keys("lengths"),
                            "speculation plan")
    # torch and transformers load only now: an argument mistake above is one line in a second
    from draftsmith.data.base.device import default_device
    from draftsmith.infer.bench.calibrate_speculation import calibrate, plan_markdown
    from draftsmith.infer.drafters import Chain
    from draftsmith.infer.generator import SpeculativeGenerator

    gen = SpeculativeGenerator.from_pretrained(args.target, args.head, device=default_device(args.device),
                                               threads=args.threads, tree=Chain(max(1, max(lengths))), plan=None)
    tok = gen.tokenizer
    if tok is None:
        raise ValueError(f"{args.target}: calibration reads prompts as text and needs the target's tokenizer")
    prompts = load_prompts(args, tok)
    pad = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
    plan = calibrate(gen, prompts, batch_sizes, lengths, args.max_new_tokens, pad, args.warmup, args.repeats)
    plan.save(out)
    print(plan_markdown(plan))
    print("plan: " + ", ".join(f"batch {b}: {'off' if n == 0 else f'{n} drafts'}" for b, n in plan.lengths.items()))
    print(f"written to {out}")
    return {"lengths": plan.lengths, "measured": plan.measured, "out": str(out)}


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
