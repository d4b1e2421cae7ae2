"""Building blocks shared by the EAGLE heads: RMSNorm, RoPE, attention with a tiny KV cache, MLP.

Written out (rather than borrowed from a transformers modeling file) because EAGLE-3's attention
reads a 2H-wide input, and so the heads do not depend on private transformers internals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN


@dataclass
class HeadOutput:
    hidden_states: Tensor  # (B, T, H)
    past_key_values: "HeadCache | None" = None


class HeadCache:
    """Per-layer keys/values of shape (B, H_kv, S, D), appended along S."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def update(self, layer_idx: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

    def select(self, index: Tensor) -> None:
        """Keep the positions ``index`` (1-D LongTensor), in that order."""
        self.keys = [k.index_select(2, index) for k in self.keys]
        self.values = [v.index_select(2, index) for v in self.values]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()  # the variance in fp32, as HF's Llama does
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, rope: dict) -> Tensor:
    """Inverse frequencies (head_dim/2,) for the rope types heads support: default, linear, llama3."""
    theta = float(rope.get("rope_theta", 10000.0))
    # fp32, as transformers and the serving engines compute it (the head must match them exactly)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_context = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type '{kind}' is not supported by draftsmith heads (default, linear, llama3)")


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """cos/sin for explicit position ids. inv_freq is derived from the config, not stored."""

    def __init__(self, head_dim: int, rope: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = dict(rope)
        self._inv_freq: Tensor | None = None

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._inv_freq is None or self._inv_freq.device != position_ids.device:
            self._inv_freq = rope_inv_freq(self.head_dim, self.rope).to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive (1, 1, Q, K) attention mask of a bool (Q, K) ``allowed``: 0 where a query may
    attend, ``finfo(dtype).min`` where it may not (the portable form for HF's eager and sdpa)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive (1, 1, q_len, kv_len) mask: the queries are the last q_len of kv_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return additive_mask(torch.arange(kv_len, device=device)[None, :] <= q_pos, dtype)


class Attention(nn.Module):
    """Multi-head attention with GQA; ``in_features`` may differ from the output width (EAGLE-3: 2H)."""

    def __init__(self, config, in_features: int, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(
        self,
        x: Tensor,  # (B, T, in_features)
        cos: Tensor,  # (B, T, D)
        sin: Tensor,
        attention_mask: Tensor | None,  # additive (B, 1, T, S) or None = causal
        cache: HeadCache | None,
    ) -> Tensor:
        bsz, q_len, _ = x.shape
        q = self.q_proj(x).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, H_kv, S, D)
        kv_len = k.shape[2]
        if attention_mask is None and 1 < q_len != kv_len:  # one new query sees every cached key: no mask
            attention_mask = causal_mask(q_len, kv_len, q.dtype, q.device)
        elif attention_mask is not None:
            if attention_mask.shape[-2:] != (q_len, kv_len):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected (B, 1, {q_len}, {kv_len})"
                )
            attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            is_causal=attention_mask is None and q_len > 1,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
