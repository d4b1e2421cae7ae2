"""Real τ at temperature > 0 of the tree rules on one fixed tree shape: token-level verification of the head's
ranked children (today's rule), and Traversal Verification of children drawn from the head's law (docs/traversal.md).

    python lab/traversal_tau.py HEAD_DIR [--target demo:tiny] [--prompts 24] [--max-new-tokens 128]
        [--prompt-tokens 32] [--temperature 1] [--seeds 2] [--variants token-fixed,traversal-sampled,...] [--out F]

Every variant decodes the same held-out stdlib prompts (``data.corpus.continuation_prompts``, as
``scripts/rank_heads.py``) one at a time, the global seed set to the same value before each (seed, prompt) decode
of each variant, variants interleaved per prompt. τ = the steps' tokens over the steps, pooled; beside each
variant's τ its ratio to the first variant's, with a 95% bootstrap interval over the (seed, prompt) decodes.
A variant is RULE-DRAFTS: RULE exact (token by token) or traversal; DRAFTS fixed (each node's most likely
tokens) or sampled (drawn without replacement from the head's law, ``StaticTree(sampled=True)``).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_real

# root: 2 children; the first expanded 3 more levels (2, then 2, then 1 wide), the second one level: 8 drafts
SHAPE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))
VARIANTS = ("exact-fixed", "traversal-fixed", "exact-sampled", "traversal-sampled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("head", type=Path)
    p.add_argument("--target", default="demo:tiny")
    p.add_argument("--prompts", type=cli_count(), default=24)
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompt-tokens", type=cli_count(), default=32)
    p.add_argument("--temperature", type=cli_real(0, above=True), default=1.0)
    p.add_argument("--seeds", type=cli_count(), default=2)
    p.add_argument("--variants", default="exact-fixed,traversal-sampled,exact-sampled,traversal-fixed")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.variants = args.variants.split(",")
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: {bad[0]!r} is not one of {', '.join(VARIANTS)}")
    return args


def ratio_interval(base: list[tuple[int, int]], other: list[tuple[int, int]], reps: int = 2000) -> tuple[float, float]:
    """95% percentile bootstrap interval of pooled τ(other) / τ(base) over paired decodes (tokens, steps)."""
    rng = random.Random(0)
    ratios = []
    for _ in range(reps):
        pick = [rng.randrange(len(base)) for _ in base]
        tb = sum(base[i][0] for i in pick) / sum(base[i][1] for i in pick)
        to = sum(other[i][0] for i in pick) / sum(other[i][1] for i in pick)
        ratios.append(to / tb)
    ratios.sort()
    return ratios[int(0.025 * reps)], ratios[int(0.975 * reps) - 1]


def decode_all(args: argparse.Namespace) -> dict[str, list[tuple[int, int]]]:
    """Per variant the (tokens, steps) of every (seed, prompt) decode."""
    import torch

    from draftsmith.data.corpus import continuation_prompts
    from draftsmith.data.targets import load_target, load_target_tokenizer, resolve_target
    from draftsmith.infer import SpeculativeGenerator, StaticTree
    from draftsmith.scripts.rank_heads import load_head

    path = resolve_target(args.target)
    target = load_target(path, attn_implementation="sdpa").eval()
    tokenizer = load_target_tokenizer(path)
    head = load_head(args.head, Path(tempfile.mkdtemp()))  # a run's output_dir or one of its checkpoints
    prompts = continuation_prompts(tokenizer, args.prompts, args.prompt_tokens, args.max_new_tokens)
    gens = {v: SpeculativeGenerator(target, head, tree=StaticTree(SHAPE, sampled=v.endswith("sampled")),
                                    acceptance=v.split("-")[0]) for v in args.variants}
    runs: dict[str, list[tuple[int, int]]] = {v: [] for v in args.variants}
    for seed in range(args.seeds):
        for i, prompt in enumerate(prompts):
            for v, gen in gens.items():
                torch.manual_seed(1000 * seed + i)
                with torch.inference_mode():
                    gen.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature)
                runs[v].append((gen.last_stats.step_tokens, gen.last_stats.steps))
            print(f"seed {seed} prompt {i}: " + " | ".join(
                f"{v} {sum(t for t, _ in r) / sum(s for _, s in r):.3f}" for v, r in runs.items()), flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = decode_all(args)
    base = args.variants[0]
    rows = []
    for v, r in runs.items():
        tau = sum(t for t, _ in r) / sum(s for _, s in r)
        low, high = ratio_interval(runs[base], r)
        rows.append({"variant": v, "tau": tau, "ratio": tau / (sum(t for t, _ in runs[base]) /
                                                              sum(s for _, s in runs[base])), "ci95": [low, high]})
        print(f"{v}: τ {tau:.3f}, {rows[-1]['ratio']:.3f}x {base} (95% {low:.3f}-{high:.3f})")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "decodes": runs, "shape": SHAPE, "temperature": args.temperature,
                                        "seeds": args.seeds, "prompts": args.prompts,
                                        "max_new_tokens": args.max_new_tokens}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
