"""Make (or reuse) the offline demo target: a Llama LM pretrained on the Python stdlib.

    python scripts/make_demo_target.py --size tiny                 # ~12 min on 2 shared CPU cores
    python scripts/make_demo_target.py --size assistant            # drafter sharing tiny's tokenizer
    python scripts/make_demo_target.py --out DIR --size tiny --max-steps 20

Without --out the result goes to the cache (``$DRAFTSMITH_CACHE``, default ``~/.cache/draftsmith``)
under a key of corpus and settings; an existing matching build is reused, never retrained.
On a CPU shared with other jobs, ``OMP_NUM_THREADS=1`` trains several times faster than torch's
default of one thread per core (threads stall waiting for each other).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data.demo import TOKENIZER_SOURCE, ensure_demo_target
from data.demo_lm import SIZES, SUMMARY_FILE, format_summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options: which demo LM, its seed and where to put it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output directory (default: the cache)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, help="override the size's number of optimizer steps")
    parser.add_argument("--tokenizer", type=Path,
                        help="tokenizer directory to reuse instead of training one; sizes "
                             f"{sorted(TOKENIZER_SOURCE)} default to the demo target's ({TOKENIZER_SOURCE})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Build (or reuse) the demo LM; prints its summary and returns its directory."""
    args = parse_args(argv)
    overrides = {"max_steps": args.max_steps} if args.max_steps is not None else {}
    out = ensure_demo_target(args.size, args.seed, out_dir=args.out, tokenizer_dir=args.tokenizer, **overrides)
    print(format_summary(json.loads((out / SUMMARY_FILE).read_text())))
    print(f"demo {args.size} LM: {out}")
    return out


if __name__ == "__main__":
    from data.cli import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
