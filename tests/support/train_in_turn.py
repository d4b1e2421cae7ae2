"""``accelerate launch tests/support/train_in_turn.py A.yaml B.yaml ...``: train/train_head.py's ``cli`` on each
config in turn, in the same launched processes (a launch's fixed cost, ~25 s of CPU for the launcher and two
workers importing torch and transformers, paid once for several trainings). Between two runs accelerate's
process-wide state is reset, so each run's ``Accelerator`` joins a fresh process group as a launch's first one
does (``setup`` ends each run with ``end_training``, which destroys its group) on its own port, from
``IN_TURN_PORTS`` (one a run after the first, comma-separated), whose store rank 0 serves: the launcher's store
(the launch's port) keeps the old group's keys, so a process that starts its next run first would read the other's
old addresses there (seen: "Gloo connectFullMesh failed ... Connection refused"; a new port left to the
launcher's store hung). Stops at the first run that fails, with its exit code."""
from __future__ import annotations

import os
import sys


def main(paths: list[str]) -> int:
    from accelerate.state import AcceleratorState

    from draftsmith.train.train_head import cli

    ports = os.environ["IN_TURN_PORTS"].split(",") if len(paths) > 1 else []
    assert len(ports) == len(paths) - 1, f"IN_TURN_PORTS: one port a run after the first, got {ports}"
    for i, path in enumerate(paths):
        if i:
            AcceleratorState._reset_state(reset_partial_state=True)
            os.environ["MASTER_PORT"] = ports[i - 1]
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 serves the new port's store itself
        code = cli(["--config", path])
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
