"""Helpers moved out of tests/infer/test_peft_targets.py (other test files share them; no tests here)."""
from __future__ import annotations

import json

import torch
from peft import LoraConfig, get_peft_model


def save_adapter(base, root, *, scale: float = 0.5, seed: int = 0):
    """Save ``base`` to ``root/base`` and a random LoRA adapter on it to ``root/adapter``; return the
    adapter's directory and the (unmerged) peft model, the independent reference."""
    base_dir, adapter_dir = root / "base", root / "adapter"
    base.save_pretrained(base_dir)
    base = type(base).from_pretrained(base_dir).eval()  # name_or_path = base_dir, as saved models have
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
    model.save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    return adapter_dir, model.eval()
