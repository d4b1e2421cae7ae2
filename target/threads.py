"""How many CPU threads to decode with, chosen by measurement and printed.

On a busy 2-core machine two intra-op threads ran generation 10-50x slower than one (they wait for a
core the other work holds), on an idle one they are faster: no fixed count is right, so a short probe
of the work decoding does (small matmuls) times 1 thread against every available core and keeps the
faster. ``OMP_NUM_THREADS`` or an explicit count skip the probe.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

PROBE_ROUNDS = 5
MARGIN = 1.1  # more threads must be 10% faster to be chosen


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def probe_seconds(threads: int, give_up: float = float("inf"), rows: int = 64) -> float:
    """Median seconds of a ``rows`` x 256 @ 256 x 256 matmul workload on ``threads`` threads (64 rows: the size
    of a decoding step's matmuls; training passes its micro-batch's tokens); stops early (returning that
    round's time) once a round takes longer than ``give_up`` seconds."""
    torch.set_num_threads(threads)
    x, w = torch.randn(rows, 256), torch.randn(256, 256)
    torch.tanh(x @ w)  # starts the thread pool outside the timing
    times = []
    for _ in range(PROBE_ROUNDS):
        start = time.perf_counter()
        for _ in range(max(2, 20 * 64 // rows)):  # about the same work per round whatever the rows
            x = torch.tanh(x @ w)
        times.append(time.perf_counter() - start)
        if times[-1] > give_up:  # clearly slower: on a busy machine a round can take half a second
            return times[-1]
    return statistics.median(times)


def choose_threads(requested: int | None = None, ignore_env: bool = False,
                   override: str = "--threads N overrides", rows: int = 64) -> str:
    """Set torch's intra-op thread count and return one line saying what was chosen and why.
    ``ignore_env``: measure even though ``OMP_NUM_THREADS`` is set (a launcher's default, not the user's);
    ``override`` ends the line of a measured choice (how the user sets a count instead); ``rows``: the
    probe's matmul height, the work's size (training's micro-batch tokens are many more than a decode step's:
    on an idle 2-core machine a 64-row probe measured the two counts within 3% and kept 1 thread, and the
    demo training then took 6 min 33 s against 4 min 05 s on 2 threads)."""
    cores = available_cores()
    if requested:
        torch.set_num_threads(requested)
        return f"threads: {requested} of {cores} cores (--threads)"
    if os.environ.get("OMP_NUM_THREADS") and not ignore_env:
        return f"threads: {torch.get_num_threads()} of {cores} cores (OMP_NUM_THREADS)"
    candidates = sorted({1, cores})
    seconds = {1: probe_seconds(1, rows=rows)}
    for n in candidates[1:]:
        seconds[n] = probe_seconds(n, give_up=3 * seconds[1], rows=rows)
    best = 1
    for n in candidates[1:]:
        if seconds[n] * MARGIN < seconds[best]:
            best = n
    torch.set_num_threads(best)
    measured = ", ".join(f"{n}: {1e3 * s:.2f} ms" for n, s in seconds.items())
    return f"threads: {best} of {cores} cores, chosen by measurement ({measured} per probe; {override})"
