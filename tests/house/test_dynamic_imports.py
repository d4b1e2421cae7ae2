"""The modules found by name at run time (a kind's training objective, a drafter) import as draftsmith.<folder>
from any working directory: pytest's rootdir puts the repository root on sys.path, where a bare
``train.objectives.dflash`` also imports, so this runs in a process started outside the repository (a script
such as lab/acceptance_curve.py, or an installed draftsmith, has no bare ``train`` to find)."""
from __future__ import annotations

import os
import subprocess
import sys


def test_objectives_and_drafters_import_by_name_outside_the_repository(tmp_path):
    probe = ("from draftsmith.heads import HEAD_CLASSES\n"
             "from draftsmith.train.objectives import objective_class\n"
             "from draftsmith.infer.drafters import drafter_class\n"
             "print(sorted(objective_class(k).__module__ for k in HEAD_CLASSES))\n"
             "print(sorted(drafter_class(k).__module__ for k in HEAD_CLASSES))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-600:]
    assert "'draftsmith.train.objectives.dflash'" in done.stdout and "draftsmith.infer.drafters." in done.stdout
