"""The default device, and the one host-device sync used wherever time is measured."""
from __future__ import annotations

import torch


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``requested`` if given, else CUDA when a GPU is present, else the CPU."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: str | torch.device | None = None) -> None:
    """Wait for queued kernels on ``device`` (all CUDA work when None): a host-device sync point.

    A no-op on the CPU, where every operation has finished when it returns."""
    if device is not None and torch.device(device).type != "cuda":
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
