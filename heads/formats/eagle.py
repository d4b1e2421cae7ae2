"""EAGLE-1/2 for vLLM (format ``eagle-vllm``): a plain one-layer Llama config."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from draftsmith.heads.common import DraftHead
from draftsmith.heads.formats.validation import (
    Artifact,
    PROVENANCE_KEY,
    context_problems,
    dtype_name,
    expect,
    float_tensors,
    ints,
    layer_spec,
    llama_layer_config,
    provenance_record,
    rope_problems,
    tensor_problems,
)


def _eagle_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """EAGLE-1 as a plain one-layer Llama config; vLLM's method "eagle" names it EagleLlamaForCausalLM."""
    if head.config.fc_bias:
        raise ValueError("fc_bias=True: vLLM's EAGLE loader builds the fc without a bias and drops fc.bias, "
                         "so this head would run without it; retrain with fc_bias=False")
    tensors = float_tensors(head.state_dict(), options["dtype"])
    dtype = dtype_name(tensors)
    config = {"architectures": ["LlamaForCausalLM"], **llama_layer_config(head, options), "torch_dtype": dtype,
              "dtype": dtype, PROVENANCE_KEY: provenance_record(head, "eagle-vllm", facts)}
    return Artifact(config, tensors)


def _eagle_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    expect(config, "architectures", ["LlamaForCausalLM"], problems, "vLLM's method eagle prefixes it with Eagle")
    expect(config, "model_type", "llama", problems)
    expect(config, "num_hidden_layers", 1, problems)
    expect(config, "tie_word_embeddings", False, problems)
    expect(config, "hidden_act", "silu", problems, "vLLM's Llama MLP")
    problems += rope_problems(config)
    shape = ints(config, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "max_position_embeddings", "vocab_size"), problems)
    problems += context_problems(shape, config.get(PROVENANCE_KEY) or {})
    if "fc.bias" in tensors:
        problems.append("unexpected tensor fc.bias: vLLM's EAGLE fc has no bias and drops it silently")
    if shape:
        h = shape["hidden_size"]
        spec = {"fc.weight": ((h, 2 * h), "float"),
                **layer_spec("layers.0.", shape, h, bool(config.get("attention_bias")), bool(config.get("mlp_bias")))}
        without_bias = {k: v for k, v in tensors.items() if k != "fc.bias"}  # reported above
        problems += tensor_problems(without_bias, spec, config.get("torch_dtype"))
    return problems
