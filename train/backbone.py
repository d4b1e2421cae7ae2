"""Medusa-2's trainable backbone: LoRA adapters (peft) on the target, trained with the heads.

The frozen original is the same model with its adapters switched off (``original``), so the
self-distillation targets need no second copy of the target. At the end of a run the adapters are
saved as a PEFT adapter (``output_dir/target-lora``, loadable as ``target=``) and merged into the
target, which is saved as a full model (``output_dir/target``): the target the heads draft for.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from draftsmith.data.base.names import ADAPTER_BASE_KEY

if TYPE_CHECKING:
    from peft import PeftModel

MERGED_TARGET = "target"  # output_dir/target: the merged target of a Medusa-2 run
LORA_ADAPTER = "target-lora"  # output_dir/target-lora: its adapter alone (base: the original target)


def add_lora(target: nn.Module, rank: int) -> PeftModel:
    """Wrap ``target`` with rank-``rank`` LoRA on every linear layer but the lm_head (peft's
    ``all-linear``); the adapters are injected into ``target``'s own modules, so ``target`` itself
    now computes base + adapter. B starts at zero: the adapted model starts as the original."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(target, config)


def lora_layers(model: nn.Module) -> list:
    """peft's adapter layers inside ``model``."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries adapters (a Medusa-2 run's target)."""
    return bool(lora_layers(model))


@contextlib.contextmanager
def original(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as the frozen original: every adapter switched off inside the block."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' trainable tensors by name (what the optimizer steps and checkpoints hold)."""
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def save_merged_target(backbone: PeftModel, tokenizer, output_dir: Path, original_name: str) -> Path:
    """Save the adapter (``LORA_ADAPTER``) and the merged target (``MERGED_TARGET``) into ``output_dir``;
    return the merged target's absolute path. Merges in place: ``backbone``'s model is the merged one
    afterwards. The merged config names the original target (``ADAPTER_BASE_KEY``)."""
    backbone.peft_config["default"].base_model_name_or_path = original_name
    backbone.save_pretrained(output_dir / LORA_ADAPTER)
    merged = backbone.merge_and_unload()
    merged.config._name_or_path = original_name
    setattr(merged.config, ADAPTER_BASE_KEY, original_name)
    path = (output_dir / MERGED_TARGET).resolve()
    merged.save_pretrained(path)
    tokenizer.save_pretrained(path)
    merged.config._name_or_path = str(path)
    return path
