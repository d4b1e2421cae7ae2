"""Publish a trained head on the Hugging Face Hub with a generated model card.

    draftsmith push --head runs/demo-eagle3 --repo-id USER/demo-eagle3
    draftsmith push --head runs/demo-eagle3 --repo-id USER/demo-eagle3-vllm --format vllm --private

Uploads config.json, the weights, README.md (target, input convention, training data, measured τ,
usage for draftsmith, vLLM and SGLang) and the training loop's metrics.jsonl/config.yaml when the head
directory has them. With --format the repo holds that engine export, so vLLM/SGLang load it by repo id.
The token comes from --token, $HF_TOKEN or `hf auth login`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.base.names import EXPORT_FORMATS
from draftsmith.data.entry_point import prog, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The upload options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=prog("push_to_hub.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, type=Path, help="head directory (train/train_head.py output_dir)")
    parser.add_argument("--repo-id", required=True, help="USER/NAME or ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--format", choices=EXPORT_FORMATS, help="upload this engine export instead of draftsmith's format")
    parser.add_argument("--revision", help="branch to push to (default: main)")
    parser.add_argument("--token", help="Hub token (default: $HF_TOKEN or the stored login)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    """Upload the head (or its ``--format`` export) with its card; returns the commit URL."""
    args = parse_args(argv)
    if not args.head.is_dir():
        raise FileNotFoundError(f"--head {args.head} is not a directory")
    from draftsmith.data.targets import hub_errors  # torch and transformers load only now: a mistake above is one line
    from draftsmith.heads.hub import push_head_to_hub

    with hub_errors(args.repo_id, upload=True):
        url = push_head_to_hub(args.head, args.repo_id, private=args.private, token=args.token, fmt=args.format,
                               revision=args.revision)
    print(f"uploaded {args.head} to {args.repo_id}: {url}")
    return url


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
