"""Whether speculative decoding can be exact on a target: greedy runs of its own decode against its verifies.

    draftsmith check-target TARGET [--steps 8] [--prompts 2] [--new-tokens 32]

Loads TARGET (a directory, Hub id or ``demo:<size>``) in fp32 on the CPU, takes ``--prompts`` greedy runs of
``--new-tokens`` tokens by the target's own ``generate`` (from short random prompts) and verifies the same
tokens ``--steps`` at a time through transformers' cache (what a speculative verify runs, with draftsmith's
routing of recurrent layers: docs/hybrid.md), comparing the logits that chose each token. Prints one line:
whether greedy speculative decoding can be exact on it, and why not (a refused or untested stateful family,
or verifies computing something else than one-token decoding beyond fp32 rounding). Exit code 0: it can;
1: it cannot; 2: bad input (a missing target, a bad argument).
"""
from __future__ import annotations

import argparse
import sys

from draftsmith.data.base.checks import cli_count
from draftsmith.data.entry_point import prog, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog("check_target.py"), description=__doc__.split("\n\n")[0])
    p.add_argument("target", help="the target: a directory, a Hub id or demo:<size>")
    p.add_argument("--steps", type=cli_count(2), default=8, help="tokens verified at once against one-token steps")
    p.add_argument("--prompts", type=cli_count(1), default=2, help="greedy runs compared")
    p.add_argument("--new-tokens", type=cli_count(2), default=32, help="tokens per greedy run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # torch and transformers load only now: a mistake above is one line

    from draftsmith.data.targets import load_target, load_target_config, resolve_target
    from draftsmith.target.decode_check import can_be_exact
    from draftsmith.target.recurrent import REFUSED_KINDS, model_type, unsupported

    path = resolve_target(args.target)
    config = load_target_config(path)
    if model_type(config) in REFUSED_KINDS:  # before the weights load
        print(unsupported(config))
        return 1
    target = load_target(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    exact, line = can_be_exact(target, args.steps, args.prompts, args.new_tokens)
    print(line)
    return 0 if exact else 1


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
