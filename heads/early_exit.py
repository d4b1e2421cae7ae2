"""Early-exit head (Kangaroo, arXiv 2404.18911): a small adapter on the target's layer-``k`` state,
decoding through the target's own lm_head.

The target's first ``exit_layer`` decoder layers are the shallow sub-network; the head reads their
output (HF ``hidden_states[exit_layer]``, the residual stream entering layer ``exit_layer``) and maps
it, through one attention layer and a norm, to a state the target's lm_head reads. Kangaroo's adapter
is "one multi-head attention and two normalization layers"; ours is exactly that:
``x + attn(input_layernorm(x))`` then ``norm``. ``o_proj`` starts at zero and ``norm`` at the
target's final norm, so a fresh head drafts exactly what training-free layer skip with the same
``k`` drafts (``infer.drafters.free.layer_skip``); training can only move it from there.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from draftsmith.heads.common import DraftHead, DraftHeadConfig, final_norm_scale, rope_config_from_target, text_config
from draftsmith.heads.layers import Attention, HeadCache, HeadOutput, RMSNorm, Rotary


class EarlyExitConfig(DraftHeadConfig):
    """Early-exit head config. Attention fields default to the target's (see ``build_head``).

    Args:
        exit_layer: k, the number of target layers the shallow sub-network runs (1 <= k < L);
            ``None`` = half the target's layers, rounded up (set by ``build_head``).
        hidden_size: the target's hidden size (the head reads its states and writes its lm_head input).
        num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, max_position_embeddings,
        rope_config, attention_bias: the adapter's attention, as in a Llama config.
        vocab_size: the target's vocabulary (the head uses the target's lm_head).
        initializer_range: std of the normal init of the q/k/v projections.
    """

    model_type = "draftsmith_early_exit"
    head_kind = "early-exit"

    def __init__(
        self,
        exit_layer: int | None = None,
        hidden_size: int = 4096,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 4096,
        rope_config: dict[str, Any] | None = None,
        attention_bias: bool = False,
        vocab_size: int = 32000,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        self.exit_layer = exit_layer
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_config = dict(rope_config or {"rope_type": "default", "rope_theta": 10000.0})
        self.attention_bias = attention_bias
        self.vocab_size = vocab_size
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


class EarlyExitHead(DraftHead):
    config_class = EarlyExitConfig
    title = "early exit (Kangaroo)"

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        k = self.config.exit_layer
        return [f"- the target's state after its first **{k}** layers (HF `hidden_states[{k}]`); "
                "one attention layer and a norm (Kangaroo's adapter); drafts with the target's own lm_head"]

    def __init__(self, config: EarlyExitConfig) -> None:
        super().__init__(config)
        layers = config.target_num_layers
        if config.exit_layer is None or config.exit_layer < 1 or (layers and config.exit_layer >= layers):
            raise ValueError(f"early-exit head exit_layer must lie in [1, {layers or 'L'} - 1] (the target's first "
                             f"k layers draft), got {config.exit_layer}")
        if config.target_hidden_size and config.hidden_size != config.target_hidden_size:
            raise ValueError(f"early-exit head hidden_size={config.hidden_size} must equal the target's "
                             f"hidden_size={config.target_hidden_size} (it reads the target's states and lm_head)")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, in_features=config.hidden_size, layer_idx=0)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is getattr(getattr(self, "self_attn", None), "o_proj", None):
            init.zeros_(module.weight)  # zero: a fresh head is the identity on the layer-k state

    @classmethod
    def config_from_target(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        config = text_config(target)
        heads = config.num_attention_heads
        return {
            **cls.config_class.identity_kwargs(target),
            "exit_layer": (config.num_hidden_layers + 1) // 2,
            "hidden_size": config.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "rms_norm_eps": getattr(config, "rms_norm_eps", 1e-6),
            "max_position_embeddings": config.max_position_embeddings,
            "rope_config": rope_config_from_target(config),
            "vocab_size": config.vocab_size,
        }

    @torch.no_grad()
    def init_from_target_model(self, target: PreTrainedModel) -> None:
        """``norm`` starts as the target's final norm (so a fresh head is layer skip at ``exit_layer``)."""
        scale = final_norm_scale(target, self.config.hidden_size, "an early-exit head decodes through the target's "
                                 "final RMS norm and lm_head; use another head kind for this target")
        self.norm.weight.copy_(scale.to(self.norm.weight))

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return (self.config.exit_layer,)

    def forward(
        self,
        hidden_states: Tensor,  # (B, T, H) the target's hidden_states[exit_layer] at tokens t_i
        position_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # additive (B, 1, T, S) or None = causal
        past_key_values: HeadCache | None = None,
    ) -> HeadOutput:
        """The target-lm_head input (B, T, H) at every position: logits = ``target.lm_head(out)``
        predict token t_{i+1}, as the target's own logits at t_i do."""
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        x = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin, attention_mask, past_key_values)
        return HeadOutput(hidden_states=self.norm(x), past_key_values=past_key_values)
