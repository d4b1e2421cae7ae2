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

``variant="dflash2"`` (Inco AI + z-lab's DFlash2, the tensor names of z-lab's ``DFlash2DraftModel``) adds
a two-tap dynamic depthwise convolution along the block around each attention and MLP sublayer
(``DynamicConv``) and a low-rank selector that re-scores each position's top-k candidates given the
token chosen before it (``CandidateSelector``). Both start as exact no-ops (identity base kernel, zero
kernel projection, zero successor codebook), so a new DFlash2 drafts exactly what the DFlash it is built
from drafts (docs/dflash.md, "DFlash2").
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.heads.common import DraftHead, check_variant, refuse_variant_options
from draftsmith.heads.eagle import EagleConfig, layer_kwargs_from_target
from draftsmith.heads.layers import MLP, RMSNorm, Rotary, rotate_half

DFLASH_ARCHITECTURE = "DFlashDraftModel"  # z-lab's published drafters; heads.formats.dflash writes and reads it
DEFAULT_BLOCK_SIZE = 16  # the published DFlash drafters (z-lab *-DFlash-b16) and SpecForge's default
DEFAULT_NUM_LAYERS = 5  # the published drafters for 4B-8B targets and speculators' DFlash default (docs/dflash.md)
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"  # z-lab's DFlash2 drafters; SGLang's DFLASH algorithm reads it
VARIANTS = ("dflash", "dflash2", "dspark", "domino")
# DFlash2's published shape (z-lab's DFlash2 config, SpecForge's and speculators' defaults): two causal taps,
# dynamic coefficients shared by 16 channels, a rank-256 selector over the top 16 candidates (docs/dflash.md)
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# the kind's options only one of its variants takes (DFlash2's here; DSpark's and Domino's classes, heads.variants,
# read theirs)
VARIANT_OPTIONS = {**dict.fromkeys(DFLASH2_DEFAULTS, "dflash2"), "markov_rank": "dspark",
                   **dict.fromkeys(("gru_hidden_dim", "emb_dim", "pure_draft_prefix_len"), "domino")}


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
        variant: ``"dflash"``, ``"dflash2"``: the dynamic convolution and the candidate selector, or
            ``"dspark"``: DSpark's Markov and confidence heads, every slot drafting the token after it, or
            ``"domino"``: Domino's GRU logit correction, every slot drafting the token after it.
        conv_kernel_size, conv_group_size, selector_rank, selector_top_k: DFlash2's shape (None with
            ``variant="dflash2"``: ``DFLASH2_DEFAULTS``; they must stay None otherwise).
        markov_rank: DSpark's Markov rank (None with ``variant="dspark"``: 256; None otherwise).
        gru_hidden_dim, emb_dim, pure_draft_prefix_len: Domino's GRU width, correction width and the leading
            slots left uncorrected (None with ``variant="domino"``: ``DOMINO_DEFAULTS``; None otherwise).
    """

    model_type = "draftsmith_dflash"
    head_kind = "dflash"
    variants = VARIANTS  # the kind's variants: its own name first
    variant_owners = VARIANT_OPTIONS  # the options only one of the kind's variants takes, and that variant
    variant = "dflash"  # the variant this class builds (an instance keeps it as a field: config.json's ``variant``)
    inline_variants = ("dflash2",)  # variants this class builds too (DSpark's and Domino's have classes of their own)

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, num_layers: int = DEFAULT_NUM_LAYERS,
                 aux_layer_ids: list[int] | None = None, mask_token_id: int | None = None, variant: str | None = None,
                 conv_kernel_size: int | None = None, conv_group_size: int | None = None,
                 selector_rank: int | None = None, selector_top_k: int | None = None,
                 markov_rank: int | None = None, gru_hidden_dim: int | None = None, emb_dim: int | None = None,
                 pure_draft_prefix_len: int | None = None, **kwargs):
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
        self.variant = check_variant(type(self), variant, VARIANTS)
        given = {"conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
                 "selector_rank": selector_rank, "selector_top_k": selector_top_k, "markov_rank": markov_rank,
                 "gru_hidden_dim": gru_hidden_dim, "emb_dim": emb_dim, "pure_draft_prefix_len": pure_draft_prefix_len}
        refuse_variant_options(self.variant, given, VARIANT_OPTIONS)
        for key in VARIANT_OPTIONS:
            setattr(self, key, None)
        self._set_variant_options(given)

    def _set_variant_options(self, given: dict) -> None:
        """Fill and check the options the variant owns (``given``: as passed, None = its default): DFlash2's
        here; DSpark's and Domino's classes (``heads.variants``) override it."""
        if self.variant != "dflash2":
            return
        for key in DFLASH2_DEFAULTS:
            setattr(self, key, int(DFLASH2_DEFAULTS[key] if given[key] is None else given[key]))
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(f"conv_kernel_size={self.conv_kernel_size} must lie in 1..block_size={self.block_size}")
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size={self.conv_group_size} must divide hidden_size={self.hidden_size}")
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank={self.selector_rank} must be at least 1")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k={self.selector_top_k} must lie in 1..vocab_size={self.vocab_size}")

    @property
    def is_dflash2(self) -> bool:
        return self.variant == "dflash2"

    # DSpark's and Domino's classes (heads.variants) say True for their own
    is_dspark = False
    is_domino = False
    # The block slot of the first draft: DFlash's slot k drafts the token k after the root (slot 0 is the root
    # itself); DSpark's and Domino's classes set 0 (slot k drafts the token k+1 after it: the root's slot drafts too)
    first_draft_slot = 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_draft_slot


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


def dynamic_convolve(x: Tensor, dynamic: Tensor, base: Tensor, group_size: int) -> Tensor:
    """Causal depthwise convolution along the block: out[i, c] = sum_t (base[t, c] + dynamic[i, t, c // group])
    * x[i - t, c], zero before the block's first position. x (..., L, H); dynamic (..., L, K, H / group);
    base (K, H). With base = [1, 0, ...] and dynamic = 0 it returns x exactly (1 * x + 0 * ... adds no rounding)."""
    out = torch.zeros_like(x)
    length = x.shape[-2]
    for t in range(base.shape[0]):
        shifted = x if t == 0 else F.pad(x[..., : length - t, :], (0, 0, t, 0))  # (..., L, H): x[i - t]
        kernel = base[t].to(x.dtype) + dynamic[..., t, :].repeat_interleave(group_size, dim=-1)  # (..., L, H)
        out = out + kernel * shifted
    return out


class DynamicConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution around one sublayer: ``prepare`` convolves the sublayer's
    input and returns the coefficients ``finish`` applies to its output; both sets come from one projection
    of the input (SGLang's "wraps each sublayer in and out from one projection of its input")."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # (in/out, K, H)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """SpecForge's init: identity base kernel, zero projection: the convolution is an exact no-op."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _blocks(self, x: Tensor) -> Tensor:
        """(B, Q, H) -> (B, Q / bs, bs, H): the convolution never crosses a block boundary."""
        batch, length, hidden = x.shape
        if length % self.block_size:
            raise ValueError(f"DFlash2 convolves whole blocks: {length} block tokens is not a multiple of "
                             f"block_size={self.block_size}")
        return x.view(batch, length // self.block_size, self.block_size, hidden)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(the convolved sublayer input (B, Q, H), the output coefficients (B, Q/bs, bs, K, G))."""
        blocks = self._blocks(x)
        dynamic = self.kernel_projection(blocks).unflatten(-1, (2, self.kernel_size, -1))  # (B, n, bs, 2, K, G)
        out = dynamic_convolve(blocks, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size)
        return out.view_as(x), dynamic[..., 1, :, :]

    def finish(self, y: Tensor, dynamic: Tensor) -> Tensor:
        return dynamic_convolve(self._blocks(y), dynamic, self.base_kernel[1], self.group_size).view_as(y)


class CandidateSelector(nn.Module):
    """DFlash2's path selector: the score of candidate b after predecessor a at a position with draft state h is
    ``unary(b) + <A[a] * W h, B[b]>`` (A, B: rank-r codebooks over the target vocabulary; W: (r, H)). The
    successor codebook B starts at zero, so the scores start as the unary logits."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        rank = config.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))  # (V, r)
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))  # (V, r)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.std = config.initializer_range
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        self.predecessor_codebook.normal_(0.0, self.std)
        self.hidden_projection.weight.normal_(0.0, self.std)
        self.successor_codebook.zero_()

    def forward(self, hidden: Tensor, predecessor: Tensor, candidates: Tensor, unary: Tensor) -> Tensor:
        """Scores (..., K) of ``candidates`` (..., K) with unary logits ``unary`` (..., K), after ``predecessor``
        (...) at draft states ``hidden`` (..., H)."""
        context = self.predecessor_codebook[predecessor] * self.hidden_projection(hidden).to(unary.dtype)  # (..., r)
        return unary + torch.einsum("...r,...kr->...k", context, self.successor_codebook[candidates].to(unary.dtype))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        if config.is_dflash2:
            shape = (config.hidden_size, config.conv_kernel_size, config.conv_group_size, config.block_size)
            self.attention_conv, self.mlp_conv = DynamicConv(*shape), DynamicConv(*shape)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, context: tuple[Tensor, Tensor],
                mask: Tensor | None) -> Tensor:
        if not hasattr(self, "attention_conv"):  # DFlash
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, cos, sin, context, mask), dynamic)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dynamic)


class DFlashHead(DraftHead):
    config_class = DFlashConfig
    _no_split_modules = ["DFlashDecoderLayer"]
    reads_formats = ("speculators", "dflash")

    def check_target(self, target) -> None:
        """The shape checks of every head, then the mask token against the target (``check_mask_token``): a
        config naming the pad, EOS or BOS token, which training refuses, is refused where it would decode."""
        super().check_target(target)
        check_mask_token(self.config.mask_token_id, target)

    @property
    def title(self) -> str:
        return "DFlash2" if self.config.is_dflash2 else "DFlash"

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        cfg = self.config
        ids = list(cfg.aux_layer_ids)
        return [f"- context: the target's states **{ids}** as HF `output_hidden_states` indices (the output of "
                f"target layers **{[i - 1 for i in ids]}**, DFlash's `target_layer_ids`), fused by fc + hidden_norm",
                f"- blocks of {cfg.block_size} tokens (the last accepted token, then mask id {cfg.mask_token_id}); "
                f"{cfg.num_layers} draft layer(s); drafts with the target's own embedding and lm_head",
                *([f"- DFlash2: a {cfg.conv_kernel_size}-tap dynamic convolution (groups of {cfg.conv_group_size} "
                   f"channels) around each sublayer; a rank-{cfg.selector_rank} selector walks the top "
                   f"{cfg.selector_top_k} candidates of each block position"] if cfg.is_dflash2 else []),
                *self._variant_input_lines()]

    def _variant_input_lines(self) -> list[str]:
        """What a variant with a class of its own adds to the card's input lines (none here)."""
        return []

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        if self.config.is_dflash2:  # only the dflash layout carries it (docs/dflash.md)
            return sglang_dflash_lines(served, serve_dir, export_step, "the DFlash2DraftModel architecture selects "
                                                                      "the convolution and the selector")
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
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(config)
        self._add_variant_modules(config)
        self.post_init()
        for module in self.modules():  # post_init's normal init reaches their linears: back to the no-op start
            if isinstance(module, DynamicConv):
                module.reset_to_identity()
            elif isinstance(module, CandidateSelector):
                module.reset()

    def _add_variant_modules(self, config: DFlashConfig) -> None:
        """A variant's own modules, registered before ``post_init`` (DSpark's and Domino's classes add theirs)."""

    @property
    def selector(self) -> CandidateSelector | None:
        """DFlash2's candidate selector; None for DFlash."""
        return getattr(self, "candidate_selector", None)

    @property
    def markov(self) -> nn.Module | None:
        """DSpark's Markov head; None for DFlash and DFlash2."""
        return getattr(self, "markov_head", None)

    # Whether this head carries Domino's GRU correction (Domino's class says True)
    domino = False

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


def sglang_dflash_lines(served: str, serve_dir: str, export_step, what: str) -> list[str]:
    """A card's SGLang lines for a head only the dflash layout carries (DFlash2, Domino): ``what`` selects it."""
    return [f"SGLang (DFLASH; {what}):", "", *export_step("dflash"), "```bash",
            f"python -m sglang.launch_server --model-path {served} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {serve_dir}", "```", ""]


def check_mask_token(mask_id: int, target, tokenizer=None) -> None:
    """Refuse (ValueError, one line naming the id) a mask token that is not an existing, ordinary row of the
    target's embedding: outside it, past the tokenizer's ids (an untrained padding row), or an alias of the
    pad, EOS or BOS token (whose embedding already means something; NeMo Automodel#2461, ModelOpt#1621).
    ``target``: the model, or its config (its ``vocab_size`` rows). Training checks it (``prepare_head``), and so
    does every load beside a target (``DFlashHead.check_target``)."""
    embeddings = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    rows = embeddings.weight.shape[0] if embeddings is not None else target.vocab_size
    if not 0 <= mask_id < rows:
        raise ValueError(f"head.mask_token_id={mask_id} is not a row of the target's embedding (0..{rows - 1})")
    if tokenizer is not None and mask_id >= len(tokenizer):
        raise ValueError(f"head.mask_token_id={mask_id} is past the tokenizer's {len(tokenizer)} ids: an untrained "
                         "padding row of the embedding; pick an id the target was trained on")
    special: dict[int, str] = {}
    sources = [getattr(target, "config", target), getattr(target, "generation_config", None), tokenizer]
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        for source in sources:
            ids = getattr(source, name, None) if source is not None else None
            for i in ids if isinstance(ids, (list, tuple)) else [ids]:
                if isinstance(i, int):
                    special.setdefault(i, name.removesuffix("_id"))
    if mask_id in special:
        raise ValueError(f"head.mask_token_id={mask_id} is the target's {special[mask_id]}: the mask must not alias "
                         "pad/EOS/BOS; set head.mask_token_id to a reserved or rare ordinary token")
