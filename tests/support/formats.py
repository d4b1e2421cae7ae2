"""Helpers moved out of tests/heads/test_formats.py (other test files share them; no tests here)."""
from __future__ import annotations

import re

import torch

from draftsmith.heads import default_aux_layer_ids


H, V, INTER, L = 32, 96, 64, 8  # make_tiny_target dims, 8 layers


def perturb(head):
    """Non-trivial norms and biases, so a swapped or skipped tensor changes values."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head.eval()


# How each engine picks the target states it feeds the fc (quoted from their loaders):
# vLLM (llama.py): before layer idx, `if idx in aux_hidden_state_layers: append(hidden_states + residual)`,
#   ids = top-level eagle_aux_hidden_state_layer_ids, else (2, L//2, L-3).
# SGLang (llama.py set_eagle3_layers_to_capture): layers_to_capture = [v + 1 for v in eagle_config ids],
#   else [2, L//2, L-3]; captured before layer i like vLLM.
# TensorRT-LLM (_torch/speculative/eagle3.py): captures the *output* of layer k for k in
#   eagle3_layers_to_capture (YAML), default (1, L//2 - 1, L - 4).
def vllm_states(config, hidden):
    return [hidden[k] for k in config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(L)]


def sglang_states(config, hidden):
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [hidden[k] for k in ([v + 1 for v in ids] if ids else default_aux_layer_ids(L))]


def trtllm_states(card: str, hidden):
    found = re.search(r"eagle3_layers_to_capture: \[([\d, ]+)\]", card)
    ids = [int(x) for x in found.group(1).split(",")] if found else [1, L // 2 - 1, L - 4]
    return [hidden[k + 1] for k in ids]  # output of layer k = state entering layer k + 1
