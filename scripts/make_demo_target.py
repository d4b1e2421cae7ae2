"""Make (or reuse) the offline demo target: a Llama LM pretrained on the Python stdlib.

    draftsmith make-demo --size tiny                 # shipped built: copied, else ~9 min on 2 idle cores
    draftsmith make-demo --size assistant            # drafter sharing tiny's tokenizer
    draftsmith make-demo --size tiny-mtp             # shipped built too: a Mellum with its MTP layer (issue 55)
    draftsmith make-demo --out DIR --size tiny --max-steps 20
    draftsmith make-demo --size tiny --ship          # after a recipe change: refresh the shipped copy

Without --out the result goes to the cache (``$DRAFTSMITH_CACHE``, default ``~/.cache/draftsmith``)
under a key of corpus and settings; an existing matching build is reused, never retrained. ``demo:tiny``
and ``demo:tiny-mtp`` ship built in ``data/demo_targets/<size>-seed0/`` and are copied from there when the
fingerprint is the one asked for (``data.demo``); ``--ship`` builds the default LM of ``--size``/``--seed`` when
the shipped copy no longer matches, and replaces the shipped copy with the build (docs/setup.md: what shipping it costs).
On CPU the thread count follows the one policy (``target.threads``: one thread against all cores,
measured; ``OMP_NUM_THREADS`` overrides): on a CPU shared with other jobs one thread trains several
times faster than two (threads stall waiting for each other), on an idle one two are faster.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count
from draftsmith.data.base.names import DEMO_SIZES
from draftsmith.data.entry_point import prog


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options: which demo LM, its seed and where to put it."""
    parser = argparse.ArgumentParser(prog=prog("make_demo_target.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output directory (default: the cache)")
    parser.add_argument("--size", choices=DEMO_SIZES, default="tiny")
    parser.add_argument("--seed", type=cli_count(0), default=0)
    parser.add_argument("--max-steps", type=cli_count(), help="override the size's number of optimizer steps")
    parser.add_argument("--tokenizer", type=Path,
                        help="tokenizer directory to reuse instead of training one; sizes that borrow one "
                             "(data.demo.TOKENIZER_SOURCE: assistant) default to the demo target's")
    parser.add_argument("--ship", action="store_true",
                        help="copy the result into data/demo_targets/SIZE-seedSEED, the copy draftsmith ships "
                             "(the default LM only: not with --out, --max-steps or --tokenizer)")
    args = parser.parse_args(argv)
    if args.ship and (args.out or args.max_steps is not None or args.tokenizer):
        parser.error("--ship ships the default demo LM of --size and --seed: drop --out, --max-steps and --tokenizer")
    return args


def main(argv: list[str] | None = None) -> Path:
    """Build (or reuse) the demo LM; prints its summary and returns its directory."""
    args = parse_args(argv)  # before torch loads: a mistake is one line in a second
    import torch

    from draftsmith.data.demo import ensure_demo_target
    from draftsmith.data.demo_lm import SUMMARY_FILE, format_summary
    from draftsmith.target.threads import choose_threads

    if not torch.cuda.is_available():
        print(choose_threads(), file=sys.stderr, flush=True)  # the one thread policy (target.threads)
    overrides = {"max_steps": args.max_steps} if args.max_steps is not None else {}
    out = ensure_demo_target(args.size, args.seed, out_dir=args.out, tokenizer_dir=args.tokenizer, **overrides)
    print(format_summary(json.loads((out / SUMMARY_FILE).read_text())))
    print(f"demo {args.size} LM: {out}")
    if args.ship:
        print(f"shipped copy: {ship(out, f'{args.size}-seed{args.seed}')}")
    return out


def ship(built: Path, name: str) -> Path:
    """Replace ``data/demo_targets/<name>`` (``data.demo.SHIPPED``) with the files of ``built``, bit for bit;
    its ``demo_target.json`` carries the fingerprint and every file's sha256 that ``data.demo`` checks."""
    from draftsmith.data.demo import SHIPPED, is_built
    from draftsmith.data.demo_lm import SUMMARY_FILE

    dest = SHIPPED / name
    if dest.exists() and is_built(dest, json.loads((built / SUMMARY_FILE).read_text())["fingerprint"]):
        return dest  # already the shipped copy: nothing to write
    tmp = SHIPPED / f".{name}.tmp-{os.getpid()}"
    try:
        shutil.copytree(built, tmp)
        if dest.exists():
            shutil.rmtree(dest)  # our own shipped folder, replaced by a build of the same request
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
