"""Train a draft head: ``accelerate launch train/train_head.py [--config FILE] [key=value ...]``.

Without ``--config`` it uses ``configs/demo.yaml``: an EAGLE-3 head on the offline demo target
(built first if missing), minutes on CPU. ``--help`` lists every key. Nothing runs at import.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"


def _fix_sys_path() -> None:
    """Run as a script, Python puts train/ first on sys.path, where config.py would shadow
    stdlib-style names; import from the repository root instead."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(here)]
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def cli(argv: list[str] | None = None) -> int:
    _fix_sys_path()
    from train.config import ConfigError
    from train.loop import parse_args, setup
    from train.metrics import format_acceptance

    try:
        cfg = parse_args(argv, default_config=DEMO_CONFIG)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    result = setup(cfg)
    from accelerate import PartialState

    if PartialState().is_main_process:
        print(f"\n{cfg.head.kind} head saved to {result.output_dir.resolve()}")
        if result.metrics:
            print(format_acceptance(result.metrics))
        if result.best_dir is not None:
            print(f"best simulated tau {result.best_tau:.3f} (head in {result.best_dir.resolve()})")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
