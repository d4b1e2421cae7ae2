"""MTP head: the target's own multi-token-prediction (MTP) block, as its family defines it (docs/mtp.md).

One MTP layer reads the target's final (post-norm) hidden state h_i at token t_i and the embedding of the
next token t_{i+1}: ``eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])``, one decoder block of the target's own
family (its attention, MLP or MoE), then a norm; the target's lm_head turns the result into the law of
t_{i+2}. Drafting chains it on its own output, as EAGLE-1 does (``infer.drafters.mtp``).

Two checkpoint layouts carry it (``heads.mtp_native`` reads and writes them):
- DeepSeek-V3 style (``num_nextn_predict_layers``): ``model.layers.{L + i}.{enorm, hnorm, eh_proj,
  shared_head.norm, <the decoder block>}``;
- Qwen3-Next / Qwen3.5 style (``mtp_num_hidden_layers``): ``mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden,
  fc, layers.N.<the decoder block>, norm}``, its norms the family's zero-centred ``(1 + w)`` RMSNorm;
- Mellum style (``num_mtp_layers``): the Qwen3-Next names, plain ``w * x`` RMSNorms, the MTP layer's attention
  and MLP types from ``mtp_layer_types`` / ``mtp_mlp_layer_types`` and its RoPE that of its layer type.

Both are built on transformers' own ``modeling_layers.MtpLayer`` (enorm, hnorm, eh_proj, ``mtp_block`` =
the family's decoder layer, ``post_norm``), the module transformers' ``MtpModel`` stacks, with the family's
decoder layer, norm and rotary classes, so the math is the target's own.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import MtpLayer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from draftsmith.heads.common import DraftHead, DraftHeadConfig, text_config
from draftsmith.heads.layers import HeadCache, HeadOutput, causal_mask
from draftsmith.heads.mtp_native import load_native, target_mtp_layers

MTP_STYLES = ("deepseek", "qwen3_next", "mellum")
MTP_INITS = ("native", "fresh")
# what a target's config records of this copy, not of its family (an export and a warm start compare the rest)
_NOT_FAMILY = ("_name_or_path", "dtype", "transformers_version")


class MtpConfig(DraftHeadConfig):
    """MTP head config (see ``build_head``: every field but ``init`` and ``num_mtp_layers`` comes from the target).

    Args:
        init: ``native`` = the target checkpoint's own MTP tensors (read when the head is built with the loaded
            target), ``fresh`` = random; None = native where the target's config declares MTP layers, else fresh.
        num_mtp_layers: MTP layers; None = the target's count (1 where it declares none).
        style: the checkpoint layout, ``deepseek``, ``qwen3_next`` or ``mellum`` (set from the target).
        family_config: the target's text config (a dict): the MTP block is built from its family's classes.
        hidden_size, vocab_size: the target's.
        initializer_range: std of the fresh init.
    """

    model_type = "draftsmith_mtp"
    head_kind = "mtp"

    def __init__(
        self,
        init: str | None = None,
        num_mtp_layers: int | None = None,
        style: str = "deepseek",
        family_config: dict[str, Any] | None = None,
        hidden_size: int = 4096,
        vocab_size: int = 32000,
        initializer_range: float = 0.02,
        **kwargs,
    ):
        if init is not None and init not in MTP_INITS:
            raise ValueError(f"init must be one of {list(MTP_INITS)}, got {init!r}")
        if style not in MTP_STYLES:
            raise ValueError(f"style must be one of {list(MTP_STYLES)}, got {style!r}")
        if num_mtp_layers is not None and (isinstance(num_mtp_layers, bool) or int(num_mtp_layers) < 1):
            raise ValueError(f"num_mtp_layers must be a whole number >= 1, got {num_mtp_layers!r}")
        if style != "deepseek" and num_mtp_layers not in (None, 1):
            raise ValueError(f"num_mtp_layers={num_mtp_layers}: the {style} layout shares one fc and its norms across "
                             "its MTP layers, which this head builds per layer: one layer only")
        self.init = init
        self.num_mtp_layers = num_mtp_layers
        self.style = style
        self.family_config = dict(family_config or {})
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.initializer_range = initializer_range
        super().__init__(**kwargs)


def family_config_of(config: MtpConfig) -> PretrainedConfig:
    """The config the MTP layers are built with: the target's text config with ``num_mtp_layers`` full-attention
    layers (as transformers' ``get_mtp_config``: layer types reset, DeepSeek's MoE from the first layer)."""
    fields = dict(config.family_config)
    model_type = fields.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"the MTP head's family_config has model_type={model_type!r}, which transformers does not know")
    family = CONFIG_MAPPING[model_type].from_dict(fields)
    n = config.num_mtp_layers or 1
    family.num_hidden_layers = n
    declared = getattr(family, "mtp_layer_types", None)  # Mellum: the MTP layers' own types (get_mtp_config)
    if getattr(family, "layer_types", None) is not None:
        family.layer_types = list(declared or ["full_attention"] * n)  # else full attention, hybrids included
    if getattr(family, "mlp_layer_types", None) is not None:
        family.mlp_layer_types = list(getattr(family, "mtp_mlp_layer_types", None) or [family.mlp_layer_types[-1]] * n)
    if hasattr(family, "first_k_dense_replace"):
        family.first_k_dense_replace = 0
    family._attn_implementation = "sdpa"
    family._experts_implementation = "eager"
    return family


def family_classes(family: PretrainedConfig) -> tuple[type, type, type]:
    """(decoder layer, rotary embedding, family PreTrainedModel) classes of ``family``'s transformers module."""
    lm_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family.model_type)
    if lm_name is None:
        raise ValueError(f"model_type {family.model_type!r} has no causal LM in transformers: no MTP block to build")
    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(family.model_type)}."
                                     f"modeling_{model_type_to_module_name(family.model_type)}")
    prefix = lm_name.removesuffix("ForCausalLM")
    layer = getattr(module, f"{prefix}DecoderLayer", None)
    rotary = getattr(module, f"{prefix}TextRotaryEmbedding", None) or getattr(module, f"{prefix}RotaryEmbedding", None)
    if layer is None or rotary is None:
        raise ValueError(f"transformers' {module.__name__} has no {prefix}DecoderLayer or {prefix}RotaryEmbedding: "
                         "no MTP block to build for this family")
    pretrained = next(c for c in getattr(module, lm_name).__mro__ if c.__name__.endswith("PreTrainedModel"))
    return layer, rotary, pretrained


class _FamilyCache:
    """A draftsmith head cache (``update(layer, key, value)``) in the call order transformers' attention
    uses (``update(key, value, layer)``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.inner.update(layer_idx, key, value)


class MtpHead(DraftHead):
    config_class = MtpConfig
    title = "MTP (multi-token prediction)"
    reads_formats = ("mtp",)

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        n = self.config.num_mtp_layers or 1
        layout = {"deepseek": "DeepSeek-V3 (`model.layers.{L+i}.*`)", "qwen3_next": "Qwen3-Next / Qwen3.5 (`mtp.*`)",
                  "mellum": "Mellum (`mtp.*`)"}[self.config.style]
        return [f"- the target's final post-norm hidden state and the next token's embedding; **{n}** MTP layer(s) "
                f"of the target's own family, {layout} layout; drafts with the target's own lm_head"]

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        """No engine loads MTP layers alone: stitch them into a copy of the target's folder and serve that
        (docs/mtp.md; the vLLM line is its method name for a target's own MTP layers, not run here)."""
        return ["Engines serve a target's own MTP layers: stitch them into a copy of the target's folder, then serve "
                "that copy:", "", *export_step("mtp"), "```bash", f"draftsmith stitch {serve_dir} {served} STITCHED_DIR",
                "vllm serve STITCHED_DIR --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 1}'",
                "```", ""]

    def __init__(self, config: MtpConfig) -> None:
        super().__init__(config)
        family = family_config_of(config)
        layer_cls, rotary_cls, self._family_pretrained = family_classes(family)
        with torch.device("meta"):
            norm_cls = type(layer_cls(family, 0).input_layernorm)  # the family's own norm (Qwen3-Next: 1 + w)
        self.layers = nn.ModuleList(MtpLayer(family, layer_cls, norm_cls, i, use_post_norm=True)
                                    for i in range(family.num_hidden_layers))
        self.rotary_emb = rotary_cls(config=family)
        # Mellum: RoPE per layer type (MtpModel's has_per_layer_rope): each MTP layer's rotary reads its type
        nested = family.nested_rope_parameter_keys(getattr(family, "rope_parameters", None) or {})
        self.rope_types = list(family.layer_types) if nested and getattr(family, "layer_types", None) else None
        self._family = family
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """The family's own init (its experts, routers, zero-centred norms), as its PreTrainedModel does it."""
        shim = self._family_pretrained.__new__(self._family_pretrained)
        object.__setattr__(shim, "config", self._family)
        self._family_pretrained._init_weights(shim, module)

    @classmethod
    def config_from_target(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        config = text_config(target)
        style, layers = target_mtp_layers(config)
        return {
            **cls.config_class.identity_kwargs(target),
            "num_mtp_layers": layers or 1,
            "style": style,
            "family_config": {k: v for k, v in config.to_dict().items() if k not in _NOT_FAMILY},
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "initializer_range": getattr(config, "initializer_range", 0.02),
        }

    @torch.no_grad()
    def init_from_target_model(self, target: PreTrainedModel) -> None:
        """``init=native`` (the default where the target declares MTP layers): the target checkpoint's own MTP
        tensors (``heads.mtp_native``); a target that declares none is refused in one line."""
        declared = target_mtp_layers(text_config(target))[1]
        init = self.config.init or ("native" if declared else "fresh")
        if init == "fresh":
            return
        load_native(self, target)
        self.config.init = "native"

    def forward(
        self,
        hidden_states: Tensor,  # (B, T, H) the target's final post-norm state at t_i (or this head's own output)
        inputs_embeds: Tensor,  # (B, T, H) the target's embeddings of t_{i+1}
        position_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # additive (B, 1, T, S) or None = causal
        past_key_values: HeadCache | None = None,
        layer: int = 0,
        run: Callable | None = None,
    ) -> HeadOutput:
        """MTP layer ``layer`` at every position: its post-norm output (B, T, H), whose ``target.lm_head``
        logits predict t_{i+2}. ``run``: what runs the layer, called as it is (None: the layer itself; a drafter
        passes ``target.lean_mtp``'s, the same ops without the module machinery)."""
        t = hidden_states.shape[1]
        cache = None if past_key_values is None else _FamilyCache(past_key_values)
        if attention_mask is None and t > 1 and past_key_values is not None and past_key_values.get_seq_length():
            attention_mask = causal_mask(t, past_key_values.get_seq_length() + t, hidden_states.dtype,
                                         hidden_states.device)
        rope = ((self.rope_types[layer],) if self.rope_types else ())
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids, *rope)
        out = (run or self.layers[layer])(inputs_embeds, hidden_states, position_embeddings, attention_mask,
                                          position_ids, cache)
        return HeadOutput(hidden_states=out, past_key_values=past_key_values)
