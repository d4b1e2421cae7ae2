"""The default device, and the one host-device sync used wherever time is measured."""
from __future__ import annotations

import torch


def default_device(requested: str | torch.device | None = None) -> torch.device:
    """``requested`` if given, else CUDA when a GPU is present, else the CPU. A requested device this
    torch cannot use is refused here, naming it (not later, inside a model's ``.to``)."""
    if not requested:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as err:
        raise ValueError(f"device {str(requested)!r} is not a torch device ({str(err).splitlines()[0]})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            built = "a CUDA build" if torch.backends.cuda.is_built() else "a CPU-only build"
            raise ValueError(f"device {str(requested)!r}: no CUDA device here (torch {torch.__version__}, {built}); "
                             "leave the device out or pass cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(requested)!r}: this machine has {count} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(requested)!r}: MPS is not available here; leave the device out or pass cpu")
    return device


def sync(device: str | torch.device | None = None) -> None:
    """Wait for queued kernels on ``device`` (all CUDA work when None): a host-device sync point.

    A no-op on the CPU, where every operation has finished when it returns."""
    if device is not None and torch.device(device).type != "cuda":
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
