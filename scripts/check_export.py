"""Check an export against its consumer's own code: the drafts it computes must equal the head's.

    draftsmith check-export exports/spec --head runs/demo-eagle3 --target demo:tiny [--install]

The export is validated as its engine reads it (``validate_export``). A ``speculators`` export is then loaded
by speculators 0.9.0's own ``from_pretrained`` (in its venv, ``heads.formats.parity``; ``--install`` creates
it) and run on the same target states as the head: EAGLE-3 drafts every position for ``--steps`` steps
(training-time test, teacher-forced), DFlash drafts a block at every anchor; each step (block position)
prints its max |logit difference| and how many drafted tokens agree, and for DFlash what vLLM's reader
makes of the causal flag. The library drafts from target states we give it, so what selects them (the aux
layer ids vLLM reads) is checked as for every format: the export must be what ``--head`` exports in that
format now (every config key but the recorded target facts, every tensor), so a flipped flag, a changed
block size or layer list, or another head's export exits 1. Formats no consumer library runs here are
checked that way alone (and at config level, docs/export-keys.md). Exit 0 when all agree, 1 on any
mismatch, 2 on a usage error. The venv goes to ``$DRAFTSMITH_VENVS/speculators-0.9.0`` (default
``~/.cache/draftsmith/venvs``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_real
from draftsmith.data.entry_point import prog, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The check's options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=prog("check_export.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="the export directory")
    parser.add_argument("--head", required=True, help="the head the export was written from (ours)")
    parser.add_argument("--target", required=True, help="the target (path, Hub id or demo:<size>); the consumer "
                        "reads it as the verifier")
    parser.add_argument("--steps", type=cli_count(), default=3, help="EAGLE-3 draft steps compared")
    parser.add_argument("--tokens", type=cli_count(), default=24, help="target positions drafted from")
    parser.add_argument("--atol", type=cli_real(0.0), default=1e-4, help="largest logit difference that still agrees")
    parser.add_argument("--python", type=Path, help="an interpreter that imports speculators (default: its venv)")
    parser.add_argument("--install", action="store_true", help="create the speculators venv if it is missing "
                        "(pip, from the package index; in $DRAFTSMITH_VENVS, default ~/.cache/draftsmith/venvs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Validate the export, run its consumer, print one line per step; 0 when all agree, 1 otherwise."""
    args = parse_args(argv)
    if args.tokens <= args.steps:
        raise ValueError(f"--tokens {args.tokens} must exceed --steps {args.steps} (the last --steps positions "
                         "are not compared)")
    if not (args.export / "config.json").is_file():
        raise FileNotFoundError(f"{args.export}/config.json: no such file; is {args.export} an export?")
    # torch, transformers and the heads load only now: an argument mistake above is one line in a second
    from draftsmith.data.targets import load_target, resolve_target
    from draftsmith.heads import AutoHead
    from draftsmith.heads.formats import PROVENANCE_KEY, validate_export
    from draftsmith.heads.formats.parity import speculators_python
    from draftsmith.heads.formats.validation import read_json_object
    from draftsmith.train.export_parity import consumer_parity

    config = read_json_object(args.export / "config.json")
    fmt = (config.get(PROVENANCE_KEY) or {}).get("format")
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
    head = AutoHead.from_pretrained(args.head).float().eval()
    target_path = resolve_target(args.target)
    if fmt != "speculators":
        return _without_library(head, fmt, args.export, target_path, valid)
    python = args.python or speculators_python(create=args.install)
    target = load_target(target_path).float().eval()
    try:
        lines, ok = consumer_parity(head, target, config, python, args, target_path)
    except RuntimeError as err:  # the library refused the export: that is a mismatch too
        lines, ok = [str(err)], False
    print("\n".join(lines))
    # what the library does not read from the export (our target states stand in for the verifier's layers)
    # is what vLLM does read: the export must also be what --head exports now
    same = _print_head_differences(head, fmt, args.export, target)
    print("parity: ok" if ok and valid and same else "parity: MISMATCH")
    return 0 if ok and valid and same else 1


def _without_library(head, fmt: str, export: Path, target_path, valid: bool) -> int:
    """A format no consumer library runs here: the export against what ``--head`` exports in it."""
    from transformers import AutoConfig

    print(f"no consumer library for '{fmt}' runs here: the keys its engines read are tabled in "
          "docs/export-keys.md (tests/heads/test_export_keys.py checks we write them)")
    ok = _print_head_differences(head, fmt, export, AutoConfig.from_pretrained(target_path)) and valid
    print("export: ok" if ok else "export: MISMATCH")
    return 0 if ok else 1


def _print_head_differences(head, fmt: str, export: Path, target) -> bool:
    """Print what differs between the export and what ``head`` exports as ``fmt`` now (or that nothing
    does); True when nothing does."""
    from draftsmith.heads.formats.differences import export_differences

    differences = export_differences(head, export, fmt, target)
    print("\n".join(f"--head: {line} MISMATCH" for line in differences) or f"--head: the export is what "
          f"{head.head_kind} head {getattr(head, 'name_or_path', '') or '--head'} exports as '{fmt}' ok")
    return not differences


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
