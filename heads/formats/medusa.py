"""Medusa for vLLM (``medusa-vllm``) and for TGI / TensorRT-LLM's converter (``medusa-tgi``)."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from draftsmith.heads.common import DraftHead
from draftsmith.heads.formats.validation import (
    Artifact,
    PROVENANCE_KEY,
    TensorSpec,
    dtype_name,
    expect,
    float_tensors,
    ints,
    provenance_record,
    tensor_problems,
)


def _medusa_vllm_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    cfg = head.config
    tensors = float_tensors(head.state_dict(), options["dtype"])  # names already follow vLLM's layout
    dtype = dtype_name(tensors)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "truncated_vocab_size": cfg.vocab_size,
        "medusa_fc_bias": True,  # vLLM's default is False, and then it skips the block biases silently
        "torch_dtype": dtype,
        "dtype": dtype,
        PROVENANCE_KEY: provenance_record(head, "medusa-vllm", facts),
    }
    return Artifact(config, tensors)


def _medusa_tgi_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    cfg = head.config
    if not facts["name_or_path"]:
        raise ValueError("TGI loads the base model from base_model_name_or_path: the head records no target "
                         "by Hub id (a local path is not written into exports); pass target= (--target) a config "
                         "or model whose name_or_path is its Hub id")
    state = head.state_dict()
    renamed = {}
    for i in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            renamed[f"{i}.{j}.linear.weight"] = state[f"blocks.{i}.layers.{j}.weight"]
            renamed[f"{i}.{j}.linear.bias"] = state[f"blocks.{i}.layers.{j}.bias"]
        renamed[f"{i}.{cfg.num_layers}.weight"] = state[f"lm_heads.{i}.weight"]
    tensors = float_tensors(renamed, options["dtype"])
    config = {
        # no "architectures": TGI then drops a Medusa speculator for anything but an MLP speculator
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": facts["name_or_path"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": dtype_name(tensors),
        PROVENANCE_KEY: provenance_record(head, "medusa-tgi", facts),
    }
    return Artifact(config, tensors, weights_file="medusa_lm_head.safetensors")


def _medusa_vllm_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    expect(config, "model_type", "medusa", problems)
    expect(config, "architectures", ["MedusaModel"], problems)
    expect(config, "medusa_fc_bias", True, problems, "otherwise vLLM skips the block biases")
    # vLLM's MedusaConfig.from_pretrained renames every top-level key containing "num" and "heads"/"layers"
    clashing = [k for k in config if "num" in k and ("heads" in k or "layers" in k)
                and k not in ("num_heads", "num_hidden_layers")]
    if clashing:
        problems.append(f"top-level keys {clashing} would be renamed to num_heads/num_hidden_layers by vLLM")
    sizes = ints(config, ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers", "truncated_vocab_size"),
                  problems)
    if not sizes:
        return problems
    if sizes["truncated_vocab_size"] != sizes["vocab_size"]:
        problems.append("truncated_vocab_size must equal vocab_size (a reduced Medusa vocab needs a token_map)")
    h, v = sizes["hidden_size"], sizes["vocab_size"]
    spec: TensorSpec = {}
    for i in range(sizes["num_heads"]):
        for j in range(sizes["num_hidden_layers"]):
            spec[f"blocks.{i}.layers.{j}.weight"] = ((h, h), "float")
            spec[f"blocks.{i}.layers.{j}.bias"] = ((h,), "float")
        spec[f"lm_heads.{i}.weight"] = ((v, h), "float")
    return problems + tensor_problems(tensors, spec, config.get("torch_dtype"))


def _medusa_tgi_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    if "architectures" in config:
        problems.append("config has 'architectures': TGI then treats the speculator as non-Medusa and drops it")
    if not config.get("base_model_name_or_path"):
        problems.append("base_model_name_or_path is empty (TGI loads the target from it)")
    sizes = ints(config, ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"), problems)
    if not sizes:
        return problems
    h, v, n = sizes["hidden_size"], sizes["vocab_size"], sizes["medusa_num_layers"]
    spec: TensorSpec = {}
    for i in range(sizes["medusa_num_heads"]):
        for j in range(n):
            spec[f"{i}.{j}.linear.weight"] = ((h, h), "float")
            spec[f"{i}.{j}.linear.bias"] = ((h,), "float")
        spec[f"{i}.{n}.weight"] = ((v, h), "float")
    return problems + tensor_problems(tensors, spec, config.get("torch_dtype"))
