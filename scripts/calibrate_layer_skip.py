"""Choose the layer-skip ``k`` for a target by measurement, and save it where ``--drafter layer-skip`` looks.

    draftsmith calibrate-layer-skip --target DIR|demo:tiny [--layers 1,2,3] [--depth 4]
        [--num-prompts 4] [--prompt-tokens 128] [--max-new-tokens 64] [--device cpu] [--dtype float32]

Decodes held-out demo-corpus prompts (or ``--prompts FILE.jsonl``) greedily with the target's first k
layers drafting a chain of ``--depth``, for every k (default: 1 .. L-1), and picks the k with the most
tokens per second (``infer.bench.calibrate_layer_skip``). The choice goes to the cache
(``$DRAFTSMITH_CACHE/layer-skip/<target>-<hash>.json``, keyed by the target's identity, device type and
dtype: ``infer.drafters.free.layer_skip.calibration_path``); ``python -m draftsmith.infer.generate_command --drafter layer-skip`` then
drafts with that k. Running it again overwrites the file; ``layer-skip:K`` still forces a k.
"""
from __future__ import annotations

import argparse
import json
import sys

from draftsmith.data.base.checks import cli_count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory, hub id or demo:<size>")
    p.add_argument("--layers", default="", help="comma-separated k to try (default: every k from 1 to L-1)")
    p.add_argument("--depth", type=cli_count(), default=4, help="drafts per step (the CLI's default chain)")
    p.add_argument("--prompts", help="JSONL with {'prompt': str} or {'messages': [...]} rows (default: held-out corpus)")
    p.add_argument("--num-prompts", type=cli_count(), default=4)
    p.add_argument("--prompt-tokens", type=cli_count(), default=128, help="prompt length for held-out corpus prompts")
    p.add_argument("--max-new-tokens", type=cli_count(), default=64)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--threads", type=cli_count(), default=None, help="torch CPU threads (default: target.threads' policy)")
    args = p.parse_args(argv)
    try:
        args.layers = [int(k) for k in args.layers.split(",") if k.strip()]
    except ValueError:
        p.error(f"--layers takes comma-separated layer counts, got {args.layers!r}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Measure every k, write the calibration file, print the table; returns the result."""
    args = parse_args(argv)  # before torch loads: a mistake is one line at once
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.data.base.device import default_device
    from draftsmith.data.targets import resolve_target
    from draftsmith.infer.bench.calibrate_layer_skip import calibrate_layer_skip, calibration_markdown
    from draftsmith.infer.bench.prompts import load_prompts
    from draftsmith.infer.drafters.free.layer_skip import calibration_path
    from draftsmith.target.model import decoder_layers
    from draftsmith.target.threads import choose_threads

    device = default_device(args.device)
    if device.type == "cpu":
        print(choose_threads(args.threads), file=sys.stderr, flush=True)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    path = resolve_target(args.target)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    target.generation_config.eos_token_id = None  # every prompt decodes max_new_tokens
    num_layers = len(decoder_layers(target))
    layers = args.layers or list(range(1, num_layers))
    bad = [k for k in layers if not 1 <= k < num_layers]
    if bad:
        raise ValueError(f"--layers: {bad} are not in 1..{num_layers - 1} (the target has {num_layers} layers)")
    prompts = load_prompts(args, AutoTokenizer.from_pretrained(path))
    result = calibrate_layer_skip(target, prompts, layers, args.depth, args.max_new_tokens)
    result["target"] = args.target
    out = calibration_path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(calibration_markdown(result))
    print(f"layer skip on {args.target}: k={result['best_layers']} (written to {out})")
    return result


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
