"""How many bytes a hybrid target's recurrent and convolution states take per sequence, from its config.

Every recurrent layer (``target.recurrent``) keeps, per sequence, a causal-conv window and (except short
conv) a recurrent matrix; their size does not grow with the context, unlike attention KV. Speculative
decoding keeps one more copy of all of them per step: the checkpoint it restores when a verify accepts
fewer tokens than it ran (``LinearStates.checkpoint``). Shapes, as transformers' layers store them:

- Gated DeltaNet (Qwen3.5/3.6, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid): conv (conv_dim = 2·key_dim +
  value_dim, kernel), key_dim = linear_num_key_heads·linear_key_head_dim, value_dim =
  linear_num_value_heads·linear_value_head_dim; recurrent (linear_num_value_heads, linear_key_head_dim,
  linear_value_head_dim).
- Kimi Delta Attention (Kimi-Linear, Bailing-hybrid): conv (3·linear_num_heads·linear_head_dim, kernel);
  recurrent (linear_num_heads, linear_head_dim, linear_head_dim).
- Mamba-2 (Nemotron-H, Bamba, Granite-4-H, Falcon-H1, Zamba2): conv (d_inner + 2·n_groups·d_state,
  d_conv), d_inner = heads·head_dim (Falcon-H1: mamba_d_ssm); recurrent (heads, head_dim, d_state).
- Mamba-1 (Jamba, Zamba): conv (d_inner = mamba_expand·hidden, d_conv); recurrent (d_inner, d_state)
  (Zamba splits it over its mamba heads: the same count).
- Short conv (LFM2, LFM2-MoE, LFM3): conv (hidden, conv_L_cache); no recurrent state.

Conv windows are held in the model's dtype, recurrent matrices in fp32 whatever the model's dtype (what
transformers' kernels return: measured with bf16 models of every tiny hybrid in tests/support/hybrids.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from draftsmith.target.recurrent import RECURRENT_LAYER_TYPES, is_hybrid, layer_kind, layer_types

RECURRENT_STATE_BYTES = 4  # fp32 recurrent matrices, in any model dtype


@dataclass(frozen=True)
class StateShape:
    """One recurrent layer's per-sequence state: element counts and how they were computed."""

    kind: str  # target.recurrent.LAYER_KINDS' values: "Gated DeltaNet", "Mamba-2", "Mamba-1", "short conv", ...
    conv: int  # elements of the conv window
    recurrent: int  # elements of the recurrent matrix (0: none)
    formula: str

    def nbytes(self, dtype_bytes: int) -> int:
        """Bytes per sequence with the model in a ``dtype_bytes``-byte dtype."""
        return self.conv * dtype_bytes + self.recurrent * RECURRENT_STATE_BYTES


def _get(config, *names: str) -> int:
    """The first of ``names`` the config sets (configs of different families name one size differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__}: none of {', '.join(names)} in the config")


def layer_state(config) -> StateShape:
    """The state shape shared by every recurrent layer of ``config`` (a text config), by its family's layer
    kind (``target.recurrent.layer_kind``: one line for a family draftsmith does not support) and its own keys."""
    c, kind = config, layer_kind(config)
    if kind == "Gated DeltaNet":
        kh, vh = _get(c, "linear_num_key_heads"), _get(c, "linear_num_value_heads")
        kd, vd, k = _get(c, "linear_key_head_dim"), _get(c, "linear_value_head_dim"), _get(c, "linear_conv_kernel_dim")
        conv_dim = 2 * kh * kd + vh * vd
        return StateShape(kind, conv_dim * k, vh * kd * vd,
                          f"conv (2·{kh}·{kd} + {vh}·{vd}) × kernel {k} + recurrent {vh} v-heads × {kd} × {vd}")
    if kind == "Kimi Delta Attention":
        h, d, k = _get(c, "linear_num_heads"), _get(c, "linear_head_dim"), _get(c, "linear_conv_kernel_dim")
        return StateShape(kind, 3 * h * d * k, h * d * d,
                          f"conv (3·{h}·{d}) × kernel {k} + recurrent {h} heads × {d} × {d}")
    if kind == "short conv":
        h, k = _get(c, "hidden_size"), _get(c, "conv_L_cache")
        return StateShape(kind, h * k, 0, f"conv hidden {h} × L_cache {k}")
    if kind == "Mamba-1":
        inner = _get(c, "mamba_expand") * _get(c, "hidden_size")
        k, n = _get(c, "mamba_d_conv"), _get(c, "mamba_d_state")
        return StateShape(kind, inner * k, inner * n,
                          f"conv d_inner {inner} × d_conv {k} + recurrent d_inner {inner} × d_state {n}")
    heads = _get(c, "mamba_num_heads", "mamba_n_heads", "n_mamba_heads")  # Mamba-2
    dim = _get(c, "mamba_head_dim", "mamba_d_head", "mamba_headdim")
    n, groups = _get(c, "ssm_state_size", "mamba_d_state"), _get(c, "n_groups", "mamba_n_groups", "mamba_ngroups")
    k = _get(c, "conv_kernel", "mamba_d_conv")
    inner = _get(c, "mamba_d_ssm") if getattr(c, "mamba_d_ssm", None) else heads * dim
    return StateShape(kind, (inner + 2 * groups * n) * k, heads * dim * n, f"conv (d_inner {inner} + 2·{groups}·{n}) "
                      f"× d_conv {k} + recurrent {heads} heads × {dim} × {n}")


@dataclass(frozen=True)
class StateMemory:
    """Per-sequence state bytes of a hybrid target, and the checkpoint speculative decoding keeps per step."""

    layers: int  # recurrent layers
    shape: StateShape
    dtype_bytes: int

    @property
    def per_sequence(self) -> int:
        return self.layers * self.shape.nbytes(self.dtype_bytes)

    @property
    def checkpoint(self) -> int:
        """One copy of every state, taken before each step (``LinearStates.checkpoint``)."""
        return self.per_sequence

    def formula(self) -> str:
        s = self.shape
        return (f"{self.layers} {s.kind} layers × ({s.conv:,} conv × {self.dtype_bytes} B + {s.recurrent:,} recurrent "
                f"× {RECURRENT_STATE_BYTES} B) [{s.formula}]")


def state_memory(config, dtype_bytes: int) -> StateMemory | None:
    """The states of ``config``'s model in a ``dtype_bytes``-byte dtype; None for a model without any."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not is_hybrid(text):
        return None
    layers = sum(t in RECURRENT_LAYER_TYPES for t in layer_types(text))
    return StateMemory(layers, layer_state(text), dtype_bytes)


__all__ = ["RECURRENT_STATE_BYTES", "StateMemory", "StateShape", "layer_state", "state_memory"]
