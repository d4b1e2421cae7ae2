"""Medusa-1 head: K residual-block heads on the target's final hidden state.

Head k reads the post-final-norm hidden state h_t and predicts token t+k+2 (the target's own
lm_head predicts t+1). Each head is ``num_layers`` blocks ``x + SiLU(W x + b)`` with W zero-initialised
(so a fresh head starts as the identity) and its own lm_head, initialised from the target's.
Parameter names follow vLLM's Medusa layout (``blocks.{i}.layers.{j}``, ``lm_heads.{i}``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from draftsmith.data.base.checks import count
from draftsmith.heads.common import DraftHead, DraftHeadConfig, text_config


class MedusaConfig(DraftHeadConfig):
    """Medusa head config.

    Args:
        num_heads: K, the number of future tokens drafted per step (head k predicts t+k+2).
        num_layers: residual blocks per head.
        hidden_size: the target's hidden size.
        vocab_size: the target's vocabulary size.
    """

    model_type = "draftsmith_medusa"
    head_kind = "medusa"

    def __init__(self, num_heads: int = 4, num_layers: int = 1, hidden_size: int = 4096, vocab_size: int = 32000, **kwargs):
        count("Medusa num_heads", num_heads)
        count("Medusa num_layers", num_layers)
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        super().__init__(**kwargs)


class ResBlocks(nn.Module):
    """``num_layers`` residual blocks x + SiLU(W x + b); each block is its own module."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=True) for _ in range(num_layers)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHead(DraftHead):
    config_class = MedusaConfig
    title = "Medusa"

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        cfg = self.config
        return [f"- the target's final post-norm hidden state (its lm_head input); {cfg.num_heads} heads of "
                f"{cfg.num_layers} residual block(s) each, head k predicts token t+k+2 (the target predicts t+1)"]

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        return ["vLLM:", "", *export_step("medusa-vllm"), "```bash",
                f"vllm serve {served} --speculative-config '{{\"method\": \"medusa\", \"model\": \"{serve_dir}\", "
                f"\"num_speculative_tokens\": {self.config.num_heads}}}'", "```", "",
                "TGI (the target comes from `base_model_name_or_path`):", "", *export_step("medusa-tgi"),
                "```bash", f"text-generation-launcher --model-id {serve_dir}", "```", ""]

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__(config)
        self.blocks = nn.ModuleList([ResBlocks(config.hidden_size, config.num_layers) for _ in range(config.num_heads)])
        self.lm_heads = nn.ModuleList(
            [nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)]
        )
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # transformers visits leaf modules (a container without parameters of its own is skipped for
        # custom code), so tell the block linears (biased) from the lm_heads (bias-free) here.
        if isinstance(module, nn.Linear) and module.bias is not None:
            init.zeros_(module.weight)  # zero: every head starts as the identity map
            init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=0.02)

    @classmethod
    def config_from_target(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        tcfg = text_config(target)
        return {**super().config_from_target(target), "hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size}

    def init_from_target_model(self, target: PreTrainedModel) -> None:
        """Medusa's initialisation: every head's lm_head starts as a copy of the target's."""
        self.init_lm_heads_from(target)

    @torch.no_grad()
    def init_lm_heads_from(self, target: PreTrainedModel) -> None:
        """Copy the target's lm_head into every head's lm_head (Medusa's initialisation)."""
        weight = target.get_output_embeddings().weight  # (V, H)
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(
                f"target lm_head has shape {tuple(weight.shape)}, the Medusa head expects "
                f"({self.config.vocab_size}, {self.config.hidden_size})"
            )
        for lm_head in self.lm_heads:
            lm_head.weight.copy_(weight.to(lm_head.weight))

    def forward(self, hidden_states: Tensor) -> Tensor:
        """Logits (K, B, T, V) from the target's final post-norm hidden states (B, T, H)."""
        return torch.stack([lm_head(block(hidden_states)) for block, lm_head in zip(self.blocks, self.lm_heads)])
