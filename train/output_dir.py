"""Where a training run writes: only into an output_dir that is absent, empty or ours (issue 22).

Ours means marked by ``RUN_MARKER``, written first into every run's output_dir (runs from before the
marker are recognised by their metrics.jsonl or a complete checkpoint). ``overwrite_output_dir=true``
replaces only such a folder; a file, someone's own files, or a target model are refused whatever
the options, before anything is written.
"""
from __future__ import annotations

import json
from pathlib import Path

from draftsmith.data.base.names import is_head_model_type
from draftsmith.train.checkpoint import BEST, CHECKPOINTS, METRICS_FILE, RUN_MARKER
from draftsmith.train.config import ConfigError, TrainConfig
from draftsmith.train.resume import check_not_complete, latest_checkpoint


def is_our_run(output_dir: Path) -> bool:
    """Whether ``output_dir`` was written by a draftsmith training run: our marker (written first), or
    for runs from before it, a metrics.jsonl or a complete checkpoint."""
    return ((output_dir / RUN_MARKER).is_file() or (output_dir / METRICS_FILE).is_file()
            or latest_checkpoint(output_dir) is not None)


def check_output_dir(cfg: TrainConfig) -> None:
    """Write only into an output_dir that is absent, empty or ours; a fresh run (no ``resume_from``)
    must not replace an earlier run's results unless asked to (``overwrite_output_dir=true``).

    A file, a folder holding someone else's files (a README.md, a config.yaml) or a model that is
    not a draftsmith head (a target's config.json) is refused whatever the options: overwriting
    would delete or change files that draftsmith did not create.
    """
    output_dir = Path(cfg.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output_dir={output_dir} is a file, not a directory; choose another output_dir")
    if not output_dir.is_dir() or not any(output_dir.iterdir()):
        return
    config = output_dir / "config.json"
    model_type = _model_type(config) if config.is_file() else None
    if not is_our_run(output_dir) or (config.is_file() and not is_head_model_type(model_type)):
        names = sorted(p.name for p in output_dir.iterdir())
        what = (f"a model that is not a draftsmith head (config.json model_type={model_type})"
                if config.is_file() and not is_head_model_type(model_type) else
                f"files that no draftsmith run wrote ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})")
        raise ConfigError(f"output_dir={output_dir} holds {what}; draftsmith never writes into it, not even with "
                          "overwrite_output_dir=true or resume_from: choose a new or empty output_dir")
    check_not_complete(cfg, output_dir)
    if cfg.resume_from is not None or cfg.overwrite_output_dir:
        return
    earlier = [name for name in (CHECKPOINTS, BEST, METRICS_FILE, "model.safetensors") if (output_dir / name).exists()]
    if earlier:
        steps = latest_checkpoint(output_dir)
        where = f" (latest checkpoint {steps.name})" if steps else ""
        raise ConfigError(f"output_dir={output_dir} holds an earlier run ({', '.join(earlier)}){where}: pass "
                          "resume_from=latest to continue it, overwrite_output_dir=true to replace it, or choose "
                          "another output_dir")


def _model_type(config: Path) -> object:
    try:
        return json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError, OSError):
        return None
