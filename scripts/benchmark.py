"""Every decoding method on one target, the same prompts, the same run — against the physical bound.

    draftsmith bench --target DIR --heads HEAD_DIR [HEAD_DIR ...] [--assistant DIR]
        [--prompts FILE.jsonl] [--num-prompts 8] [--max-new-tokens 128] [--trees default,tree,chain4]
        [--adaptive] [--lookup-first] [--profile] [--train-throughput] [--batch-sizes 1,4] [--temperatures 0,0.7,1] [--out DIR]

Methods: vanilla greedy ``generate`` (eager, DynamicCache); ``hf-static``: HF ``generate`` with
``cache_implementation="static"`` (HF compiles it on CUDA: the vanilla baseline that counts on a GPU;
``--no-hf-static`` skips it); HF assisted generation (``--assistant``, a small LM sharing the tokenizer) next to our
draft-model drafter with the same LM (a chain of 4, and adaptive), and the same chain with the LM's own drafts guessed
by prompt lookup or by ``--assistant-head``; HF prompt-lookup decoding (unless ``--no-prompt-lookup``) next to our
n-gram drafter (chain, tree of 3 matches, adaptive); with ``--adaptive`` each head also drafts an adaptive-length
chain, with ``--lookup-first`` its default draft behind prompt lookup (``infer.drafters.free.lookup_first``); each
head with every draft shape in ``--trees`` (``infer.tree_shape``, the language ``draftsmith generate --tree`` reads:
default, tree, chainN, dynD-K-N, medusaN; by default ``default,tree,chain4``; a shape equal to an earlier one runs
once, one the head's kind cannot draft is skipped). Per method: median tokens/s over prompts and repeats (after
warm-up), speedup over vanilla, τ (tokens per verification forward), the mean number of tokens each verification
forward carried, peak memory (CUDA only), and whether the greedy output is identical to vanilla's. Speedups are
reported against vanilla and against hf-static. Heads run on the one decode path (a preallocated static cache),
compiled or not per ``--compile`` (default: the device's, ``infer.generator.default_compile``); t(N) is that verify
step's.

The bound: a verification forward over N tokens costs t(N) on this hardware; a method with acceptance τ verifying N
tokens per step can at best be τ·t(1)/t(N) times faster than vanilla (drafting for free). efficiency = t(N) / measured
seconds per step says how much of that we keep (every column is defined in ``infer.bench.report.COLUMNS`` and under
the table).

``--batch-sizes 1,4`` adds batch speculation: per batch size, the first B prompts left-padded into one batch, HF's
batched ``generate(cache_implementation="static")`` against every speculative method whose verify runs eager
(``infer.bench.batch``), tokens/s over all rows.

``--profile`` adds where a speculative step's time goes per head method (draft, observe, verify, accept, compact,
emit; on a hybrid target "rollback": the recurrent states' restore and replay of the accepted tokens, with the
checkpoint copy inside "draft"). ``--train-throughput`` adds head-training tokens/s against the target's forward-only
tokens/s. ``--temperatures 0,0.7,1`` adds sampled decoding at each T > 0 (``infer.bench.sampled``: HF's against every
generator method, seeded per prompt; τ with its interval, vLLM's acceptance names). Writes results.json, results.md, plots.

A hybrid target (``target.recurrent``: Gated DeltaNet, Mamba, short-conv layers, e.g. demo:tiny-hybrid) runs every
method that drafts chains; HF's assisted generation and prompt lookup (transformers refuses stateful models) and trees
are skipped, each named with its reason under the table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_counts, cli_real, cli_temperatures
from draftsmith.data.base.paths import claim_report_dir
from draftsmith.data.entry_point import prog
from draftsmith.infer.bench.prompts import load_prompts
from draftsmith.infer.tree_shape import FORMS, parse_tree_shape

__all__ = ["load_prompts", "main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's options (see the module docstring)."""
    p = argparse.ArgumentParser(prog=prog("benchmark.py"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory, hub id, demo:<size> or demo:smollm2")
    p.add_argument("--heads", nargs="*", default=[], help="trained head directories")
    p.add_argument("--assistant", help="small LM sharing the tokenizer, for HF assisted generation (dir, hub id, demo:assistant)")
    p.add_argument("--assistant-head", help="a head trained on --assistant: the assistant's drafts guessed by it "
                   "(draft-lm+head:chain4, infer.drafters.free.hierarchical)")
    p.add_argument("--prompts", help="JSONL with {'prompt': str} or {'messages': [...]} rows, or demo:mtbench")
    p.add_argument("--num-prompts", type=cli_count(), default=8)
    p.add_argument("--prompt-tokens", type=cli_count(), default=128, help="prompt length for held-out corpus prompts")
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--repeats", type=cli_count(), default=3)
    p.add_argument("--warmup", type=cli_count(0), default=1)
    p.add_argument("--trees", default="default,tree,chain4",
                   help="comma-separated draft shapes per head (infer.tree_shape): default (what generate decodes with: "
                        "on CPU an EAGLE head's adaptive chain), tree, chainN, dynD-K-N, medusaN")
    p.add_argument("--no-prompt-lookup", action="store_true", help="skip HF prompt-lookup decoding")
    p.add_argument("--no-hf-static", action="store_true", help="skip HF generate with a static cache")
    p.add_argument("--compile", default=None,
                   help="compile the heads' verify step: true, false or a torch.compile backend such as aot_eager "
                        "(default: the device's, infer.generator.default_compile)")
    p.add_argument("--prompt-lookup-tokens", type=cli_count(), default=10)
    p.add_argument("--adaptive", action="store_true", help="also run each head with an adaptive-length chain")
    p.add_argument("--lookup-first", action="store_true",
                   help="also run each head behind prompt lookup (lookup drafts when it finds >= 2 tokens)")
    p.add_argument("--layer-skip", type=cli_counts(), default=[],
                   help="comma-separated K: also self-speculate with the target's first K layers (a chain of 4)")
    p.add_argument("--tree-sizes", type=cli_counts(), default="1,2,4,8,16,32,48,64,96,128")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--threads", type=cli_count(), default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS, else 1 or all cores, whichever a short probe measures faster)")
    p.add_argument("--train-throughput", action="store_true", help="also measure head-training tokens/s")
    p.add_argument("--profile", action="store_true", help="also time each phase of a head method's step (an extra pass)")
    p.add_argument("--batch-sizes", type=cli_counts(), default=[],
                   help="comma-separated batch sizes, e.g. 1,4: batch speculation against HF's batched static generate")
    p.add_argument("--temperatures", type=cli_temperatures, default=[0.0],
                   help="comma-separated temperatures: each T > 0 adds sampled decoding (e.g. 0,0.7,1; 0 = greedy)")
    p.add_argument("--top-p", type=cli_real(0, 1, above=True), default=1.0, help="top-p at T > 0 (1 = off)")
    p.add_argument("--top-k", type=cli_count(0), default=0, help="top-k at T > 0 (0 = off)")
    p.add_argument("--max-minutes", type=cli_real(0, above=True), default=None,
                   help="start no new prompt after this many minutes (every method keeps the same prompts; "
                        "the report counts the prompts timed)")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    if args.assistant_head and not args.assistant:
        p.error("--assistant-head guesses the assistant's drafts: pass --assistant too")
    args.compile = {None: None, "true": True, "false": False}.get(args.compile, args.compile)
    args.trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    if not args.trees:
        p.error(f"--trees: no tree given; use {FORMS}")
    for tree in args.trees:
        try:
            parse_tree_shape(tree)
        except ValueError as e:
            p.error(f"--trees: {e}")
    return args


def train_throughput(target: str) -> dict[str, dict]:
    """Head-training tokens/s per demo recipe against the target's forward-only tokens/s (``--train-throughput``)."""
    from tqdm.auto import tqdm

    from draftsmith.train.args import parse_args as train_args
    from draftsmith.train.throughput import measure_throughput

    configs = Path(__file__).resolve().parents[1] / "configs"
    demo = {"medusa": "demo-medusa.yaml", "eagle": "demo-eagle.yaml", "eagle3": "demo.yaml"}
    return {kind: measure_throughput(train_args([f"target={target}"], default_config=configs / name))
            for kind, name in tqdm(demo.items(), desc="training throughput")}


def main(argv: list[str] | None = None) -> dict:
    """Run every method (``infer.bench.run``), write results.json, results.md and plots to ``--out``; returns them."""
    args = parse_args(argv)
    claim_report_dir(args.out)  # before minutes of timing: a folder of someone else's files is refused now
    # torch, transformers and the decoders load only now: an argument mistake is one line in a second
    from draftsmith.infer.bench.report import write_report
    from draftsmith.infer.bench.run import run_benchmark

    result = run_benchmark(args, " ".join(sys.argv))
    if args.train_throughput:
        result["train_throughput"] = train_throughput(args.target)
    write_report(Path(args.out), result)
    return result


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
