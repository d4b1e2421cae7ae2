"""Timing that includes queued device work, and counting the target's forwards."""
from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from draftsmith.data.base.device import sync
from draftsmith.target.model import decoder_layers


def timed(fn: Callable[[], Any], warmup: int, repeats: int) -> tuple[float, Any]:
    """(median seconds, last result) over ``repeats`` calls after ``warmup`` calls; each call is
    timed between two host-device syncs, so the time includes the kernels it queued."""
    out, times = None, []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def hardware(device: torch.device) -> str:
    """The GPU's name, or the CPU and the thread count torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    """Peak allocated device memory since the last reset, MiB (None on the CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


class ForwardCounter:
    """Counts target forwards and their query lengths with a pre-hook on the first decoder layer."""

    def __init__(self, target) -> None:
        self.lengths: list[int] = []
        self._layer = decoder_layers(target)[0]
        self._handle = None
        self.enabled(True)

    def enabled(self, on: bool) -> None:
        """Hook on or off: off while a compiled method runs (a hook would be traced into its graph)."""
        if on and self._handle is None:
            self._handle = self._layer.register_forward_pre_hook(self._hook, with_kwargs=True)
        elif not on and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.lengths.append(int(hidden.shape[1]))

    def reset(self) -> None:
        self.lengths = []
