"""DFlash head (block diffusion drafter, arXiv 2602.06036): one forward drafts a whole block.

Context: the target's states after layers ``build_target_layer_ids(L, num_layers)`` (here as HF
hidden_states indices, +1), concatenated and fused by ``fc`` then ``hidden_norm`` into one context
vector per accepted token. Block: ``[last accepted token, MASK, ..., MASK]`` (``block_size`` tokens)
embedded with the target's frozen embedding. Every draft layer projects K/V from the context (not
input-normed) and from its normed block input; queries come only from the block; the block attends
to all its context and to itself without a causal mask. Qwen3-style ``q_norm``/``k_norm`` per head.
The output is normed by the head's own ``norm`` and read through the target's lm_head; block
position k (1..B-1) drafts the token k after the root. The facts and their sources: docs/dflash.md.

Context K/V depend only on the context (not on the block), so inference keeps them in a cache,
appended as tokens are accepted (``extend_context``) and never recomputed.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from heads.common import DraftHead
from heads.eagle import EagleConfig, layer_kwargs_from_target
from heads.layers import MLP, RMSNorm, Rotary, rotate_half

DFLASH_ARCHITECTURE = "DFlashDraftModel"  # z-lab's published drafters; heads.formats.dflash writes and reads it
DEFAULT_BLOCK_SIZE = 16  # the published DFlash drafters (z-lab *-DFlash-b16) and SpecForge's default
DEFAULT_NUM_LAYERS = 5  # the published drafters for 4B-8B targets and speculators' DFlash default (docs/dflash.md)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default context layers as 0-based target layer indices (the state *after* each):
    the middle layer for one draft layer, else ``num_draft_layers`` spread evenly over 1..L-3.
    Small targets (L < 5) where that range is empty or leaves the target are clamped into 0..L-2."""
    if num_target_layers < 2:
        raise ValueError(f"DFlash reads states after target layers below the last; num_target_layers="
                         f"{num_target_layers} leaves none")
    if num_draft_layers == 1:
        ids = [num_target_layers // 2]
    else:
        start, end = 1, num_target_layers - 3
        ids = [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return [min(max(i, 0), num_target_layers - 2) for i in ids]


def default_context_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """``build_target_layer_ids`` as HF hidden_states indices (the state after layer i enters layer i+1)."""
    return [i + 1 for i in build_target_layer_ids(num_target_layers, num_draft_layers)]


def check_context_layer_ids(ids: list[int], num_layers: int = 0) -> None:
    """Refuse context layers no DFlash export can name: the formats record the state *after* target
    layer k (``target_layer_ids`` = hidden_states index - 1), so index 0, the embeddings, is out, and
    so is anything from the last layer on (``num_layers``: the target's; 0 = unknown yet)."""
    if not ids:
        raise ValueError("aux_layer_ids is empty; name at least one target layer")
    top = f"{num_layers - 1}" if num_layers else "L-1"
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 1 or (num_layers and i >= num_layers)]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} are outside 1..{top}: DFlash reads hidden_states after a target "
                         "layer below the last (0 is the embeddings, which no DFlash export can name)")


class DFlashConfig(EagleConfig):
    """DFlash head config (layer fields as ``EagleConfig``, defaulting to the target's).

    Args:
        block_size: tokens per block (the root plus ``block_size - 1`` masks); drafts up to
            ``block_size - 1`` tokens per forward.
        num_layers: draft decoder layers.
        aux_layer_ids: HF hidden_states indices of the context features; default
            ``build_target_layer_ids(L, num_layers)`` + 1.
        mask_token_id: the target token id whose (frozen) embedding fills the masked positions;
            default the target's last id ``vocab_size - 1``.
    """

    model_type = "draftsmith_dflash"
    head_kind = "dflash"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, num_layers: int = DEFAULT_NUM_LAYERS,
                 aux_layer_ids: list[int] | None = None, mask_token_id: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if block_size < 2:
            raise ValueError(f"block_size={block_size}: a DFlash block needs the root and at least one mask (>= 2)")
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: a DFlash head needs at least one layer")
        self.fc_bias = False  # the published fc has none
        self.block_size = int(block_size)
        self.num_layers = int(num_layers)
        layers = self.target_num_layers
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else (
            default_context_layer_ids(layers, self.num_layers) if layers else [])
        if self.aux_layer_ids or layers:
            check_context_layer_ids(self.aux_layer_ids, layers or 0)
        self.mask_token_id = self.vocab_size - 1 if mask_token_id is None else int(mask_token_id)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}")


class DFlashAttention(nn.Module):
    """Block queries over [context keys | block keys]; GQA; per-head q_norm/k_norm; no causal mask."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """(B, H_kv, T, D) keys (normed, rotated) and values of x (B, T, H)."""
        bsz, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return k * cos + rotate_half(k) * sin, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor],
                mask: Tensor | None) -> Tensor:
        bsz, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, length, self.num_heads, self.head_dim)).transpose(1, 2)
        q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
        k, v = self.key_value(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        if mask is not None:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, length, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor],
                mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHead):
    config_class = DFlashConfig
    _no_split_modules = ["DFlashDecoderLayer"]
    title = "DFlash"
    reads_formats = ("speculators", "dflash")

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        cfg = self.config
        ids = list(cfg.aux_layer_ids)
        return [f"- context: the target's states **{ids}** as HF `output_hidden_states` indices (the output of "
                f"target layers **{[i - 1 for i in ids]}**, DFlash's `target_layer_ids`), fused by fc + hidden_norm",
                f"- blocks of {cfg.block_size} tokens (the last accepted token, then mask id {cfg.mask_token_id}); "
                f"{cfg.num_layers} draft layer(s); drafts with the target's own embedding and lm_head"]

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        if fmt == "speculators":
            return ["vLLM (the verifier, the block and the layers come from the directory):", "", "```bash",
                    f"vllm serve {serve_dir}", "```", ""]
        return ["vLLM (speculators flavour):", "", *export_step("speculators"), "```bash",
                f"vllm serve {serve_dir}", "```", "",
                "SGLang (and z-lab's `DFlashDraftModel` code):", "", *export_step("dflash"), "```bash",
                f"python -m sglang.launch_server --model-path {served} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {serve_dir}", "```", ""]

    @classmethod
    def config_from_target(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        """Its layers mirror a target layer (as the published drafters do)."""
        return {**cls.config_class.identity_kwargs(target), **layer_kwargs_from_target(target)}

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        if not config.aux_layer_ids:
            raise ValueError("DFlashConfig.aux_layer_ids is empty; set it or target_num_layers")
        target_width = config.target_hidden_size or config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * target_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_config)
        self.post_init()

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layer_ids)

    def context_kv(self, aux_hidden: Tensor, position_ids: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's (keys, values) (B, H_kv, C, D) of context features (B, C, n·H_t) at positions (B, C)."""
        ctx = self.hidden_norm(self.fc(aux_hidden))
        cos, sin = self.rotary(position_ids, ctx.dtype)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def extend_context(self, cache: Any, aux_hidden: Tensor, position_ids: Tensor) -> None:
        """Append the context K/V of newly accepted tokens to ``cache`` (a ``HeadCache`` or
        ``StaticHeadCache``: one entry per layer)."""
        for i, (k, v) in enumerate(self.context_kv(aux_hidden, position_ids)):
            cache.update(i, k, v)

    def forward(
        self,
        block_embeds: Tensor,  # (B, Q, H) target embeddings of the block tokens (root, masks)
        position_ids: Tensor,  # (B, Q) the block tokens' positions
        context: list[tuple[Tensor, Tensor]],  # per layer (B, H_kv, C, D) keys and values
        attention_mask: Tensor | None = None,  # additive (B, 1, Q, C + Q); None = all visible
    ) -> Tensor:
        """The normed block outputs (B, Q, H); logits are the target's lm_head of them."""
        if len(context) != len(self.layers):
            raise ValueError(f"context has {len(context)} layers of K/V, the head {len(self.layers)}")
        cos, sin = self.rotary(position_ids, block_embeds.dtype)
        x = block_embeds
        for layer, kv in zip(self.layers, context):
            x = layer(x, cos, sin, kv, attention_mask)
        return self.norm(x)

    def cached_context(self, cache: Any) -> list[tuple[Tensor, Tensor]]:
        """A cache's valid entries as ``forward``'s ``context``."""
        return list(zip(cache.keys, cache.values))
