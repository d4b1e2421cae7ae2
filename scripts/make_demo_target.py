"""Make (or reuse) the offline demo target: a Llama LM pretrained on the Python stdlib.

    python scripts/make_demo_target.py --size tiny                 # ~9 min on 2 idle CPU cores
    python scripts/make_demo_target.py --size assistant            # drafter sharing tiny's tokenizer
    python scripts/make_demo_target.py --out DIR --size tiny --max-steps 20

Without --out the result goes to the cache (``$DRAFTSMITH_CACHE``, default ``~/.cache/draftsmith``)
under a key of corpus and settings; an existing matching build is reused, never retrained.
On CPU the thread count follows the one policy (``infer.threads``: one thread against all cores,
measured; ``OMP_NUM_THREADS`` overrides): on a CPU shared with other jobs one thread trains several
times faster than two (threads stall waiting for each other), on an idle one two are faster.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from data.base.checks import cli_count
from data.demo import TOKENIZER_SOURCE, ensure_demo_target
from data.demo_lm import SIZES, SUMMARY_FILE, format_summary
from infer.threads import choose_threads


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options: which demo LM, its seed and where to put it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output directory (default: the cache)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=cli_count(0), default=0)
    parser.add_argument("--max-steps", type=cli_count(), help="override the size's number of optimizer steps")
    parser.add_argument("--tokenizer", type=Path,
                        help="tokenizer directory to reuse instead of training one; sizes "
                             f"{sorted(TOKENIZER_SOURCE)} default to the demo target's ({TOKENIZER_SOURCE})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Build (or reuse) the demo LM; prints its summary and returns its directory."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(choose_threads(), file=sys.stderr, flush=True)  # the one thread policy (infer.threads)
    overrides = {"max_steps": args.max_steps} if args.max_steps is not None else {}
    out = ensure_demo_target(args.size, args.seed, out_dir=args.out, tokenizer_dir=args.tokenizer, **overrides)
    print(format_summary(json.loads((out / SUMMARY_FILE).read_text())))
    print(f"demo {args.size} LM: {out}")
    return out


if __name__ == "__main__":
    from data.cli import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
