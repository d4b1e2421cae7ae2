"""The frozen target sharded across the training processes (``train.target_sharding=fsdp``).

torch FSDP2 ``fully_shard`` on each decoder layer of the target, called directly inside the
``accelerate launch``-ed process; the trained head stays under accelerate's DDP exactly as with a
whole target. Each process keeps 1/N of every decoder layer; in the target pass each layer is
all-gathered just before its forward and freed right after it (``reshard_after_forward=True``), so
about two full layers exist at a time (the one running, the next one arriving). The target is frozen and only ever run under ``no_grad``, so FSDP keeps no gradients and no
optimizer state for it. The input embedding, final norm and lm_head stay whole on every process:
the objectives read them outside the target's forward (``no_grad_embeds``, the lm_head passed to the
loss, ``init_from_target``). Why not accelerate's FSDP plugin: docs/scaling.md.

Every FSDP forward is a collective: all processes must run the same number of target passes
(``passes_short``, ``pad_target_passes``).
"""
from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from torch import nn

from draftsmith.target.model import decoder_layers, target_forward

logger = logging.getLogger("draftsmith.train")


def shard_target(target: nn.Module, accelerator: Accelerator) -> bool:
    """Shard ``target``'s decoder layers over all processes (FSDP2) and move them to this process's
    device; returns False (target left whole) with a single process, where there is nothing to share."""
    if accelerator.num_processes == 1:
        logger.info("train.target_sharding=fsdp with one process: the target stays whole")
        return False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    layers = decoder_layers(target)
    for layer in layers:  # layer by layer: a full layer (not the full target) is on the device at a time
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    _move_unsharded(target, layers, accelerator.device)
    logger.info("target: %d decoder layers sharded over %d processes (FSDP2)", len(layers), accelerator.num_processes)
    return True


def passes_short(accelerator: Accelerator, target: nn.Module, mine: int) -> int:
    """How many target passes this process must add to its ``mine`` to match the busiest process (0
    for a whole target). Call it before any of the passes: it is a collective itself."""
    if not is_sharded(target):
        return 0
    most = accelerator.reduce(torch.tensor(mine, device=accelerator.device), reduction="max")
    return int(most) - mine  # note: a host-device sync, once per evaluation


def _move_unsharded(target: nn.Module, layers: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers outside ``layers`` (embeddings, final norm, lm_head, rotary
    tables) to ``device``. Not ``target.to(device)``: ``Module.to`` must not touch FSDP's sharded
    parameters (swapping them out breaks FSDP's bookkeeping)."""
    inside = {id(m) for m in layers.modules()}
    moved: dict[int, nn.Parameter] = {}  # tied weights (embeddings = lm_head) stay one parameter
    for module in target.modules():
        if id(module) in inside:
            continue
        for name, param in module.named_parameters(recurse=False):
            if param.device != device:
                if id(param) not in moved:
                    moved[id(param)] = nn.Parameter(param.to(device), requires_grad=False)
                setattr(module, name, moved[id(param)])
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


@torch.no_grad()
def pad_target_passes(target: nn.Module, count: int) -> None:
    """``count`` 1-token target passes whose results are discarded: a sharded target's passes are
    collectives, and held-out shards can differ by a batch (``passes_short``)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=target.device)
    for _ in range(count):
        target_forward(target, ids, compute_logits=False)


def is_sharded(target: nn.Module) -> bool:
    """Whether ``shard_target`` sharded ``target``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(decoder_layers(target)[0], FSDPModule)
