"""What this training process can tell about the ``accelerate launch`` that started it (Linux: /proc)."""
from __future__ import annotations

import os
from pathlib import Path


def launched_by_accelerate() -> bool:
    """Started by ``accelerate launch`` (or ``draftsmith launch``, which runs its launcher): the launcher sets
    ``ACCELERATE_MIXED_PRECISION`` in every process it starts."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ


def parent_cmdline() -> list[bytes] | None:
    """The parent process's command line, None where it cannot be read."""
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def threads_are_launcher_default() -> bool:
    """Whether ``OMP_NUM_THREADS`` here is only ``accelerate launch``'s default of 1 thread per CPU process:
    the launcher was given neither ``--num_cpu_threads_per_process`` nor an ``OMP_NUM_THREADS`` of its own.
    False when that cannot be told (no /proc): the count is then left as it is."""
    cmdline = parent_cmdline() if launched_by_accelerate() else None
    if cmdline is None:
        return False
    try:
        environ = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    chosen = any(part.startswith(b"--num_cpu_threads_per_process") for part in cmdline)
    return not chosen and not any(item.startswith(b"OMP_NUM_THREADS=") for item in environ)
