"""Decoding speed at real model shapes without downloading a model: random weights, an oracle drafter.

    draftsmith bench-scale --shape llama3.1-8b --out docs/bench-gpu-8b
    draftsmith bench-scale --shape smollm2-135m --out docs/bench-gpu-135m

Builds a randomly initialised target of the shape (bf16, sdpa, on CUDA when present) and measures,
on the same prompts in one run:
- HF ``generate`` eager (DynamicCache) and with ``cache_implementation="static"`` (compiled by HF),
- ``SpeculativeGenerator`` with an oracle drafter that drafts the target's own greedy continuation,
  as a chain of ``--chain`` drafts and inside a ``--tree``-node tree (the true path of depth
  ``--chain`` plus decoys), on the static cache with the compiled verify step (or ``--decode``),
- the compiled verify cost t(N) for N in ``--sizes`` plus the chain's and the tree's N,
- the bound τ·t(1)/t(N) (drafting free, no overhead), efficiency = speedup over t(1)-per-token
  decoding / bound, peak memory,
- with ``--head-draft``: what a real EAGLE-3 head of the target's dimensions (``--draft-vocab``
  tokens) costs per draft, as a chain and as an EAGLE-2 dynamic tree (depth 8, top-k 10, 60 nodes).

The oracle aims at the generator's own greedy path (``infer.bench.scale``: ``--fixpoint-rounds``).
Compilation is reported separately (compile_s) and excluded by warm-up runs. The library is
``infer.bench``; this file only parses options and writes the results.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_counts
from draftsmith.data.base.paths import claim_report_dir
from draftsmith.data.entry_point import prog
from draftsmith.infer.bench.shapes import SHAPES


def parse_args(argv=None) -> argparse.Namespace:
    """The options (see the module docstring)."""
    p = argparse.ArgumentParser(prog=prog("bench_scale.py"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    p.add_argument("--num-prompts", type=cli_count(), default=2)
    p.add_argument("--prompt-tokens", type=cli_count(), default=128)
    p.add_argument("--max-new-tokens", type=cli_count(), default=256)
    p.add_argument("--repeats", type=cli_count(), default=2)
    p.add_argument("--chain", type=cli_count(), default=5, help="oracle chain length (τ ≤ chain + 1)")
    p.add_argument("--tree", type=cli_count(2), default=60, help="nodes of the oracle tree")
    p.add_argument("--sizes", type=cli_counts(), default="1", help="extra N for the t(N) sweep (each compiles once)")
    p.add_argument("--cost-repeats", type=cli_count(), default=30)
    p.add_argument("--fixpoint-rounds", type=cli_count(), default=4)
    p.add_argument("--decode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--head-draft", action="store_true", help="also time a real EAGLE-3 head's drafts")
    p.add_argument("--draft-vocab", type=cli_count(), default=32000)
    p.add_argument("--skip-hf-eager", action="store_true")
    p.add_argument("--compare-decodes", action="store_true",
                   help="only time the oracle chain eager and compiled, round-robin")
    p.add_argument("--threads", type=cli_count(), default=None, help="torch CPU threads")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=cli_count(0), default=0)
    p.add_argument("--out", default=None, help="directory for results.json and results.md")
    args = p.parse_args(argv)
    args.sizes = sorted(set(args.sizes) | {1})
    if args.tree <= args.chain:
        p.error("--tree must be larger than --chain")
    return args


def main(argv=None) -> dict:
    """Run the benchmark, print its table, write results.json and results.md to ``--out``."""
    args = parse_args(argv)
    if args.out:
        claim_report_dir(args.out)  # before the benchmark: a folder of someone else's files is refused now
    import torch  # only now: an argument mistake above is one line in a second

    from draftsmith.infer.bench.report import scale_markdown
    from draftsmith.infer.bench.scale import run_scale

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_scale(args)
    text = scale_markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "results.md").write_text(text)
    return result


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
