"""``metrics.jsonl``: the run's log records, append-only, mirrored to the accelerate trackers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from accelerate import Accelerator

logger = logging.getLogger("draftsmith.train")


def records_up_to(text: str, step: int) -> tuple[list[str], list[int]]:
    """The lines of a metrics log whose record's step is at most ``step``, and the 1-based numbers of
    the lines that are not a JSON record with a step (a line cut by a crash, an edit)."""
    kept, damaged = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_step = int(record["step"])
        except (ValueError, TypeError, KeyError):
            damaged.append(number)
            continue
        if record_step <= step:
            kept.append(line)
    return kept, damaged


class MetricsLog:
    """Append-only ``metrics.jsonl`` (main process) mirrored to the accelerate trackers."""

    def __init__(self, accelerator: Accelerator, path: Path, resume_step: int | None) -> None:
        self.accelerator, self.path = accelerator, path
        if accelerator.is_main_process:
            kept = []
            if resume_step is not None and path.is_file():
                text = path.read_text(errors="replace")
                kept, damaged = records_up_to(text, resume_step)
                if damaged:  # the damaged log is kept beside the new one, never lost
                    aside = path.with_name(path.name + ".damaged")
                    aside.write_text(text)
                    logger.warning("%s: line(s) %s are not metrics records (cut or edited); resuming without "
                                   "them, the file as it was is kept in %s", path, ", ".join(map(str, damaged)), aside)
            path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        scalars = {}
        for name, value in record.items():
            if isinstance(value, list):
                scalars.update({f"{name}/{k}": v for k, v in enumerate(value)})
            elif isinstance(value, (int, float)):
                scalars[name] = value
        self.accelerator.log(scalars, step=record["step"])
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
