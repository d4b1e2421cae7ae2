"""Check an export against its consumer's own code: the drafts it computes must equal the head's.

    draftsmith check-export exports/spec --head runs/demo-eagle3 --target demo:tiny [--install]

The export is validated as its engine reads it (``validate_export``). A ``speculators`` export is then loaded
by speculators 0.9.0's own ``from_pretrained`` (in its venv, ``heads.formats.parity``; ``--install`` creates
it) and run on the same target states as the head: EAGLE-3 drafts every position for ``--steps`` steps
(training-time test, teacher-forced) and each step prints its max |logit difference| and how many drafted
tokens agree; DFlash compares every loaded tensor and what vLLM's reader makes of the causal flag. Exit 0
when all agree, 1 on any mismatch, 2 on a usage error. Formats no consumer library runs here are checked
at config level (docs/export-keys.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from data.base.checks import cli_count
from data.cli import run
from data.targets import load_target, resolve_target
from heads import AutoHead
from heads.formats import validate_export
from heads.formats.parity import compare_steps, compare_tensors, run_speculators, speculators_python
from train.unroll import shift_left, unroll


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="the export directory")
    parser.add_argument("--head", required=True, help="the head the export was written from (ours)")
    parser.add_argument("--target", required=True, help="the target (path, Hub id or demo:<size>); the consumer "
                        "reads it as the verifier")
    parser.add_argument("--steps", type=cli_count(), default=3, help="EAGLE-3 draft steps compared")
    parser.add_argument("--tokens", type=cli_count(), default=24, help="target positions drafted from")
    parser.add_argument("--atol", type=float, default=1e-4, help="largest logit difference that still agrees")
    parser.add_argument("--python", type=Path, help="an interpreter that imports speculators (default: its venv)")
    parser.add_argument("--install", action="store_true", help="create the speculators venv if it is missing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = json.loads((args.export / "config.json").read_text()) if (args.export / "config.json").is_file() else {}
    fmt = (config.get("draftsmith") or {}).get("format")
    fmt = "vllm" if fmt == "vllm+sglang" else fmt
    if fmt is None:
        raise ValueError(f"{args.export}/config.json: no draftsmith provenance; not an export draftsmith wrote")
    valid = True
    try:
        validate_export(args.export, fmt)
        print(f"config/tensors: valid '{fmt}' export")
    except ValueError as err:  # a broken export is a mismatch, not a usage error; the consumer still shows its effect
        print(f"config/tensors: MISMATCH {err}".replace("\n", " "))
        valid = False
    if fmt != "speculators":
        print(f"no consumer library for '{fmt}' runs here: its keys are checked against docs/export-keys.md")
        return 0 if valid else 1
    head = AutoHead.from_pretrained(args.head).float().eval()
    target_path = resolve_target(args.target)
    python = args.python or speculators_python(create=args.install)
    try:
        if head.head_kind == "dflash":
            lines, ok = _dflash(head, config, python, args.export, target_path)
        else:
            lines, ok = _eagle3(head, load_target(target_path).float().eval(), python, args, target_path)
    except RuntimeError as err:  # the library refused the export: that is a mismatch too
        lines, ok = [str(err)], False
    print("\n".join(lines))
    print("parity: ok" if ok and valid else "parity: MISMATCH")
    return 0 if ok and valid else 1


def _eagle3(head, target, python, args, target_path) -> tuple[list[str], bool]:
    """Both sides on the same target states: ``(1, T)`` tokens, their aux features ``(1, T, 3·H_t)``."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (1, args.tokens), generator=generator)
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.feature_layer_ids], dim=-1)
        embeds = target.get_input_embeddings()(ids)
        ours = [head.compute_logits(h)[0] for h in unroll(head, head.project(aux), embeds, args.steps)]
    # the library's step k reads input_ids shifted by k: ours reads token i+1+k, so it gets ids shifted by one
    inputs = {"hidden_states": aux, "input_ids": shift_left(ids, 1), "steps": torch.tensor(args.steps),
              "position_ids": torch.arange(args.tokens)[None]}
    out = run_speculators(python, args.export, str(target_path), inputs)
    theirs = [out[f"step{k}"][0] for k in range(len(out))]
    keep = args.tokens - args.steps  # the last positions read the padding each side fills its own way
    return compare_steps([o[:keep] for o in ours], [t[:keep] for t in theirs], args.atol)


def _dflash(head, config, python, export, target_path) -> tuple[list[str], bool]:
    """Every tensor as the library loads it, and the causal flag as vLLM's update_dflash derives it."""
    loaded = run_speculators(python, export, str(target_path), {"unused": torch.zeros(1)})
    lines, ok = compare_tensors({k: v.float() for k, v in head.state_dict().items()}, loaded)
    causal = not config.get("sliding_window_non_causal", True)  # vLLM update_dflash: dflash_config.causal
    lines.append(f"vLLM reader: dflash_config.causal={str(causal).lower()} "
                 f"{'MISMATCH (DFlash blocks attend both ways)' if causal else 'ok'}")
    return lines, ok and not causal


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
