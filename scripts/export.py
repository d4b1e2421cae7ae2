"""Export a trained head for a serving engine (vLLM, SGLang, TensorRT-LLM, TGI).

    draftsmith export --head runs/demo-eagle3 --to vllm --out exports/demo-eagle3
    draftsmith export --head user/my-head --to speculators --out exports/spec --target org/target-model
    draftsmith export --head runs/medusa --to medusa-tgi --out exports/medusa-tgi --dtype bfloat16

Formats: vllm and sglang (EAGLE-3, the same directory serves both and TensorRT-LLM), speculators
(EAGLE-3 or DFlash, `vllm serve DIR` alone), eagle-vllm (EAGLE-1/2), medusa-vllm, medusa-tgi, dflash
(z-lab's layout: SGLang), mtp (an MTP head in its target family's own names: `draftsmith stitch` puts it into a
copy of the target's folder, docs/mtp.md). The export is
validated after writing and refused when an engine would load it wrong; README.md ("Serve with vLLM / SGLang / TensorRT-LLM") has the
launch commands. `draftsmith check-export DIR --head HEAD --target T` then compares the export's drafts, loaded by the
consumer's own code, with the head's (scripts/check_export.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count
from draftsmith.data.base.names import EXPORT_FORMATS, is_demo, looks_like_path
from draftsmith.data.entry_point import prog, run

DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names; torch loads only after the arguments parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The export options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=prog("export.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, help="head directory or Hub repo id (anything AutoHead loads)")
    parser.add_argument("--to", required=True, choices=EXPORT_FORMATS, help="serving format")
    parser.add_argument("--out", required=True, type=Path, help="output directory (must be empty or absent)")
    parser.add_argument("--target", help="target path, Hub id or demo:<size>: checked against the head, fills "
                        "missing facts (--to speculators with an EAGLE-3 head writes its embedding, --to dspark its "
                        "embedding and lm_head: default there the head's own target, as generate defaults to it)")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)")
    parser.add_argument("--num-speculative-tokens", type=cli_count(), default=3,
                        help="speculators format: proposal length vLLM uses by default")
    parser.add_argument("--verifier", help="speculators format: the target as `vllm serve DIR` loads it (a Hub id "
                        "or a path, written as given; default the head's target by Hub id)")
    parser.add_argument("--max-position-embeddings", type=cli_count(),
                        help="context to declare (default: the larger of the head's and the target's)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier draftsmith export at --out (never any other folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Load the head (and ``--target``), export it, print and return the output directory."""
    args = parse_args(argv)  # before torch loads: a mistake is one line in a second
    import torch

    from draftsmith.data.targets import load_target, load_target_config, resolve_target
    from draftsmith.heads import AutoHead
    from draftsmith.heads.formats import export_head, needs_target_weights

    head = AutoHead.from_pretrained(args.head)
    target = None
    # speculators EAGLE-3 and dspark exports carry target tensors: its weights are read, not only its config
    weights = needs_target_weights(head, args.to)
    if weights and not args.target:
        args.target = head.config.target_name_or_path
        if not args.target:
            raise ValueError(f"{args.head} records no target (target_name_or_path) and --to {args.to} writes the "
                             "target's weights: pass --target")
        print(f"target: {args.target} (the head's own; --target overrides)", file=sys.stderr)
    if args.target:
        target_path = resolve_target(args.target)
        target = load_target(target_path, dtype="auto") if weights else load_target_config(target_path)
    out = export_head(
        head,
        args.out,
        args.to,
        target=target,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        num_speculative_tokens=args.num_speculative_tokens,
        max_position_embeddings=args.max_position_embeddings,
        overwrite=args.overwrite,
        verifier=args.verifier,
    )
    print(f"{head.head_kind} head exported as '{args.to}' to {out} (launch commands: {out / 'README.md'})")
    if args.to == "speculators":
        warn_unservable_verifier(out)
    return out


def warn_unservable_verifier(out: Path) -> None:
    """One line when ``vllm serve OUT`` cannot load the verifier the export names (not a Hub id)."""
    verifier = ((json.loads((out / "config.json").read_text()).get("speculators_config") or {}).get("verifier")
                or {}).get("name_or_path") or ""
    if is_demo(verifier):
        print(f"warning: {out}: the verifier is {verifier}, a draftsmith name that `vllm serve {out}` cannot load; "
              "export with --verifier DIR_OR_HUB_ID (or serve with the target given explicitly)", file=sys.stderr)
    elif looks_like_path(verifier) or Path(verifier).expanduser().exists():
        print(f"warning: {out}: the verifier is the local path {verifier}: `vllm serve {out}` loads it only where "
              "that folder exists; export with --verifier HUB_ID to share it", file=sys.stderr)


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
