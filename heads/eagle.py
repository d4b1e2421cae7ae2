"""EAGLE-1/2 head: fc over [embedding, feature], then one Llama decoder layer without input norm.

Input at position i is ``concat(embed(t_{i+1}), f_i)`` where f_i is the target's post-final-norm
hidden state (the one-token shift); the output is the predicted next feature f̂_{i+1}, and draft
logits are the *target's* frozen ``lm_head(f̂)``. EAGLE-2 uses the same weights with a dynamic tree.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.heads.common import DraftHead, DraftHeadConfig, rope_config_from_target, text_config
from draftsmith.heads.layers import MLP, Attention, HeadCache, HeadOutput, RMSNorm, Rotary


class EagleConfig(DraftHeadConfig):
    """EAGLE-1/2 head config. Layer fields default to the target's (see ``build_head``).

    Args:
        hidden_size: width of the head; must equal the target's hidden size.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act,
        rms_norm_eps, max_position_embeddings: the decoder layer's shape, as in a Llama config.
        rope_config: ``{"rope_type", "rope_theta", ...scaling fields}``; must match the target's.
        attention_bias, mlp_bias: biases in the decoder layer (Llama: none).
        fc_bias: bias on the fc (vLLM's EAGLE loader drops it, so off by default).
        vocab_size: the target's vocabulary (the head uses the target's lm_head).
        initializer_range: std of the normal init of linear weights.
    """

    model_type = "draftsmith_eagle"
    head_kind = "eagle"

    def __init__(
        self,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 4096,
        rope_config: dict[str, Any] | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        fc_bias: bool = False,
        vocab_size: int = 32000,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_config = dict(rope_config or {"rope_type": "default", "rope_theta": 10000.0})
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.fc_bias = fc_bias
        self.vocab_size = vocab_size
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


def layer_kwargs_from_target(target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
    """Decoder-layer config fields copied from the target (a head layer mirrors a target layer)."""
    config = text_config(target)
    heads = config.num_attention_heads
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "hidden_act": getattr(config, "hidden_act", "silu"),
        "rms_norm_eps": getattr(config, "rms_norm_eps", 1e-6),
        "max_position_embeddings": config.max_position_embeddings,
        "rope_config": rope_config_from_target(config),
        "vocab_size": config.vocab_size,
    }


class EagleDecoderLayer(nn.Module):
    """A Llama decoder layer whose input_layernorm is removed (EAGLE-1)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config, in_features=config.hidden_size, layer_idx=0)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: HeadCache | None) -> Tensor:
        x = x + self.self_attn(x, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(DraftHead):
    config_class = EagleConfig
    title = "EAGLE (1/2)"

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        return ["- the target's final post-norm hidden state f_i and the target's embedding of token i+1 "
                "(embedding first in the fc input); drafts with the target's own lm_head"]

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        return ["vLLM:", "", *export_step("eagle-vllm"), "```bash",
                f"vllm serve {served} --speculative-config "
                f"'{{\"method\": \"eagle\", \"model\": \"{serve_dir}\", \"num_speculative_tokens\": 3}}'", "```", ""]

    @classmethod
    def config_from_target(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        """A head layer mirrors a target layer."""
        return {**cls.config_class.identity_kwargs(target), **layer_kwargs_from_target(target)}
    _no_split_modules = ["EagleDecoderLayer"]

    def __init__(self, config: EagleConfig) -> None:
        super().__init__(config)
        if config.hidden_size != config.target_hidden_size and config.target_hidden_size:
            raise ValueError(
                f"EAGLE head hidden_size={config.hidden_size} must equal the target's "
                f"hidden_size={config.target_hidden_size} (it reads the target's features and lm_head)"
            )
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([EagleDecoderLayer(config)])
        self.rotary = Rotary(config.head_dim, config.rope_config)
        self.post_init()

    def forward(
        self,
        hidden_states: Tensor,  # (B, T, H) target features f_i
        inputs_embeds: Tensor,  # (B, T, H) target embedding of t_{i+1}
        position_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # additive (B, 1, T, S) or None = causal
        past_key_values: HeadCache | None = None,
    ) -> HeadOutput:
        x = self.fc(torch.cat([inputs_embeds, hidden_states], dim=-1))  # embedding first
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attention_mask, past_key_values)
        return HeadOutput(hidden_states=x, past_key_values=past_key_values)
