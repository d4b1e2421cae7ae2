"""The training's command line, ``[--config FILE] [key=value ...]`` -> ``TrainConfig``.

Apart from ``train.run`` (which loads torch, accelerate and transformers) so that a mistake in the
arguments is one line before they load (15-26 s on a busy 2-core machine).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.entry_point import prog
from draftsmith.train.config import ConfigError, TrainConfig, help_text, load_config


def parse_args(argv: list[str] | None = None, default_config: str | Path | None = None) -> TrainConfig:
    """``[--config FILE] [key=value ...]`` -> ``TrainConfig`` (``default_config`` when no --config)."""
    parser = argparse.ArgumentParser(
        prog=prog("train_head.py"), formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a draft head on a frozen target.")
    parser.add_argument("--config", help="YAML config file (default: %(default)s)", default=default_config)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=default_config)
    chosen, _ = pre.parse_known_args(argv)
    if {"-h", "--help"} & set(argv if argv is not None else sys.argv[1:]):
        try:  # --help shows the values this run would start from (the head kinds load the heads: torch)
            effective, where = load_config(chosen.config), f"values of {chosen.config} and the built-in defaults"
        except ConfigError:
            effective, where = None, "built-in defaults"
        parser.epilog = f"keys ({where}):\n" + help_text(effective)
    args = parser.parse_intermixed_args(argv)  # key=value before and after --config
    notes: list[str] = []
    cfg = load_config(args.config, args.overrides, default_file=args.config == default_config, notes=notes)
    for note in notes:
        print(note, file=sys.stderr)
    return cfg
