"""``metrics.jsonl``: the run's log records, append-only, mirrored to the accelerate trackers."""
from __future__ import annotations

import json
from pathlib import Path

from accelerate import Accelerator


class MetricsLog:
    """Append-only ``metrics.jsonl`` (main process) mirrored to the accelerate trackers."""

    def __init__(self, accelerator: Accelerator, path: Path, resume_step: int | None) -> None:
        self.accelerator, self.path = accelerator, path
        if accelerator.is_main_process:
            lines = path.read_text().splitlines() if resume_step is not None and path.is_file() else []
            kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step]
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
