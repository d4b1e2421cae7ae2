"""Put an MTP head back into its target: a copy of the target's folder with the head's tensors in the family's
own names (docs/mtp.md).

    draftsmith export --head runs/mtp --to mtp --out exports/mtp --target TARGET_DIR
    draftsmith stitch exports/mtp TARGET_DIR OUT_DIR        # or the head itself: draftsmith stitch runs/mtp ...

TARGET_DIR is read, never written; OUT_DIR must be absent or empty (--overwrite replaces an earlier stitch).
vLLM and SGLang then serve OUT_DIR with its own MTP layers (e.g. vLLM's `--speculative-config
'{"method": "mtp", "num_speculative_tokens": 1}'`); transformers loads it as the same target.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.entry_point import prog, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog("stitch.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an --to mtp export, or an MTP head directory")
    parser.add_argument("target_dir", type=Path, help="the target's checkpoint folder (read only)")
    parser.add_argument("out_dir", type=Path, help="where the stitched copy goes (absent or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier stitch at OUT_DIR (never any other folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from draftsmith.heads.mtp_stitch import stitch

    out = stitch(args.source, args.target_dir, args.out_dir, overwrite=args.overwrite)
    print(f"MTP tensors of {args.source} stitched into a copy of {args.target_dir}: {out}")
    return out


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
