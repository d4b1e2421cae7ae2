"""What every serving format shares: the export ``Artifact``, the Llama layer config and provenance the
EAGLE formats write, and the checks every validator uses (names, shapes, dtypes, RoPE, context)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from draftsmith.heads.common import DraftHead
from draftsmith.heads.eagle3 import AUX_LAYERS


PROVENANCE_KEY = "draftsmith"  # nested, so no engine parses it (vLLM renames top-level *num*heads* keys)


FORMAT_VERSION = 1


EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


HF_CONVENTION = "HF hidden_states index: the residual stream entering layer k (0 = embeddings)"


NORM_OUTPUT_MEANING = ("post-norm: with norm_output true the next step and lm_head read norm(out) (vLLM, "
                       "speculators, NeMo, SGLang); SpecForge reads the key otherwise (docs/export-keys.md)")


# RoPE types the engines' Llama layers implement exactly as transformers does, with their parameters.
ENGINE_ROPE_PARAMS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


ENGINE_AUX_LAYERS = AUX_LAYERS


_TARGET_FIELDS = ("name_or_path", "architecture", "model_type", "hidden_size", "num_layers", "vocab_size",
                  "max_position_embeddings")


TensorSpec = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, "float" | "int64" | "bool")


@dataclass
class Artifact:
    """What one export writes: config.json, one safetensors file, and the weights file's name."""

    config: dict[str, Any]
    tensors: dict[str, Tensor]
    weights_file: str = "model.safetensors"


def float_tensors(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Detached contiguous CPU copies; floating point ones cast to ``dtype`` (ids and masks never are)."""
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous().clone()  # clone: safetensors refuses shared storage
    return out


def dtype_name(tensors: dict[str, Tensor]) -> str:
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"the head's weights mix dtypes {sorted(map(str, dtypes))}; pass dtype= to export one")
    return str(dtypes.pop()).removeprefix("torch.")


def _rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """Legacy ``rope_theta``/``rope_scaling`` (read by engines on transformers 4) and v5 ``rope_parameters``."""
    rope = dict(rope)
    rope_type = rope.get("rope_type", "default")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": None if rope_type == "default" else scaling,
        "rope_parameters": rope,
    }


def llama_layer_config(head: DraftHead, options: dict[str, Any]) -> dict[str, Any]:
    """The one-decoder-layer Llama config both EAGLE formats describe their layer with."""
    cfg = head.config
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": options["max_position_embeddings"],
        **_rope_fields(cfg.rope_config),
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
    }


def provenance_record(head: DraftHead, fmt: str, facts: dict[str, Any]) -> dict[str, Any]:
    block: dict[str, Any] = {"format": fmt, "format_version": FORMAT_VERSION, "head_kind": head.head_kind,
                             "target": dict(facts)}
    if head.head_kind == "eagle3":
        block["aux_layer_ids"] = list(head.config.aux_layer_ids)
        block["aux_layer_convention"] = HF_CONVENTION
        block["norm_output_meaning"] = NORM_OUTPUT_MEANING
    return block


def raise_problems(problems: list[str], what: str) -> None:
    if problems:
        raise ValueError(f"{what}:\n  - " + "\n  - ".join(problems))


def expect(config: dict[str, Any], key: str, want: Any, problems: list[str], why: str = "") -> None:
    if config.get(key) != want:
        problems.append(f"config {key}={config.get(key)!r}, expected {want!r}" + (f" ({why})" if why else ""))


def expect_tensor(tensors: dict, name: str, want: tuple | None, problems: list[str], why: str) -> None:
    """``name`` present, floating point, of shape ``want``; ``why`` says what its absence costs."""
    tensor = tensors.get(name)
    if tensor is None:
        problems.append(f"missing tensors ['{name}'] ({why})")
    elif tuple(tensor.shape) != want or not tensor.is_floating_point():
        problems.append(f"{name}: {tensor.dtype} {tuple(tensor.shape)}, expected a float {want}")


def ints(config: dict[str, Any], keys: tuple[str, ...], problems: list[str]) -> dict[str, int] | None:
    values = {k: config.get(k) for k in keys}
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        problems.append(f"config needs positive integers for {bad}, got {[values[k] for k in bad]}")
        return None
    return values  # type: ignore[return-value]


def rope_problems(layer: dict[str, Any]) -> list[str]:
    problems = []
    params = layer.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:
        return [f"config rope_parameters={params!r} must be a dict with rope_theta (transformers 5 reads it)"]
    rope_type = params.get("rope_type", "default")
    if rope_type not in ENGINE_ROPE_PARAMS:
        return [f"rope_type '{rope_type}' is not supported for export; engines and heads agree on "
                f"{sorted(ENGINE_ROPE_PARAMS)}"]
    extra = set(params) - ENGINE_ROPE_PARAMS[rope_type] - {"rope_type", "rope_theta"}
    missing = ENGINE_ROPE_PARAMS[rope_type] - set(params)
    if extra or missing:
        problems.append(f"rope_parameters for '{rope_type}': unsupported keys {sorted(extra)}, "
                        f"missing {sorted(missing)}")
    legacy = _rope_fields(params)
    for key in ("rope_theta", "rope_scaling"):
        if layer.get(key) != legacy[key]:
            problems.append(f"config {key}={layer.get(key)!r} disagrees with rope_parameters "
                            f"(expected {legacy[key]!r})")
    return problems


def context_problems(shape: dict[str, int] | None, provenance: dict[str, Any]) -> list[str]:
    context = (provenance.get("target") or {}).get("max_position_embeddings") or 0
    if shape and shape["max_position_embeddings"] < context:
        return [f"max_position_embeddings={shape['max_position_embeddings']} is below the target's context "
                f"{context}; positions past it wreck acceptance"]
    return []


def layer_spec(prefix: str, layer: dict[str, int], attn_in: int, attn_bias: bool, mlp_bias: bool) -> TensorSpec:
    h, i = layer["hidden_size"], layer["intermediate_size"]
    q, kv = layer["num_attention_heads"] * layer["head_dim"], layer["num_key_value_heads"] * layer["head_dim"]
    shapes = {"self_attn.q_proj": (q, attn_in), "self_attn.k_proj": (kv, attn_in), "self_attn.v_proj": (kv, attn_in),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    spec: TensorSpec = {f"{prefix}{name}.weight": (shape, "float") for name, shape in shapes.items()}
    for name, (out_features, _) in shapes.items():
        if (attn_bias and name.startswith("self_attn")) or (mlp_bias and name.startswith("mlp")):
            spec[f"{prefix}{name}.bias"] = ((out_features,), "float")
    spec[f"{prefix}post_attention_layernorm.weight"] = ((h,), "float")
    return spec


def name_problems(expected: Iterable[str], tensors: Iterable[str], note: str = "") -> list[str]:
    """Missing and unexpected tensor names, sorted."""
    expected, tensors = set(expected), set(tensors)
    problems = []
    if missing := sorted(expected - tensors):
        problems.append(f"missing tensors {missing}")
    if extra := sorted(tensors - expected):
        problems.append(f"unexpected tensors {extra}" + (f" ({note})" if note else ""))
    return problems


def tensor_problems(tensors: dict[str, Tensor], spec: TensorSpec, dtype: Any) -> list[str]:
    problems = name_problems(spec, tensors, "engines skip unknown names silently")
    for name in sorted(set(spec) & set(tensors)):
        (shape, kind), tensor = spec[name], tensors[name]
        if tuple(tensor.shape) != shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, the config implies {shape}")
        want = {"int64": torch.int64, "bool": torch.bool}.get(kind)
        if want is not None and tensor.dtype != want:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {want}")
        if kind == "float" and (not tensor.is_floating_point() or (dtype and str(tensor.dtype) != f"torch.{dtype}")):
            problems.append(f"{name}: dtype {tensor.dtype}, config torch_dtype is {dtype!r}")
    return problems


def read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def read_tensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise ValueError(f"{path}: cannot read the weights ({err}); the file is incomplete or corrupt") from err
