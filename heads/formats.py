"""Serving-engine formats: export a head for vLLM, SGLang, TensorRT-LLM and TGI; import public EAGLE-3.

| format          | head   | weights file               | loads in                                          |
|-----------------|--------|----------------------------|---------------------------------------------------|
| `vllm`/`sglang` | eagle3 | model.safetensors          | vLLM eagle3, SGLang EAGLE3, TensorRT-LLM Eagle3   |
| `speculators`   | eagle3 | model.safetensors          | vLLM alone (`vllm serve DIR`), speculators lib;   |
|                 |        | (layer named `layers.0.*`) | not SGLang                                        |
| `eagle-vllm`    | eagle  | model.safetensors          | vLLM eagle                                        |
| `medusa-vllm`   | medusa | model.safetensors          | vLLM medusa                                       |
| `medusa-tgi`    | medusa | medusa_lm_head.safetensors | TGI, TensorRT-LLM's Medusa converter              |

`vllm` and `sglang` name the same directory: one export serves all three EAGLE-3 engines.

EAGLE-3 aux-layer ids come in two conventions. draftsmith, HF `output_hidden_states` and vLLM's
top-level `eagle_aux_hidden_state_layer_ids` index the residual stream *entering* layer k (0 =
embeddings). SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` and TensorRT-LLM's
`eagle3_layers_to_capture` count the *output* of layer k, i.e. k + 1 in HF terms.

Engines skip misnamed tensors silently (acceptance ≈ 1), so every export is checked in memory, written
to a temporary directory, read back and checked again (key set, shapes, dtypes, values, d2t
invariants, config fields) before it is moved into place. README.md ("Serve with vLLM / SGLang / TensorRT-LLM") lists the engine loader code
each format was checked against.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from heads.common import DraftHead, target_identity
from heads.eagle3 import AUX_LAYERS, Eagle3Config, Eagle3Head, engine_aux_layer_ids

FORMAT_KINDS = {
    "vllm": "eagle3",
    "sglang": "eagle3",
    "speculators": "eagle3",
    "eagle-vllm": "eagle",
    "medusa-vllm": "medusa",
    "medusa-tgi": "medusa",
}
FORMATS = tuple(FORMAT_KINDS)
PROVENANCE_KEY = "draftsmith"  # nested, so no engine parses it (vLLM renames top-level *num*heads* keys)
FORMAT_VERSION = 1
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
HF_CONVENTION = "HF hidden_states index: the residual stream entering layer k (0 = embeddings)"
# RoPE types the engines' Llama layers implement exactly as transformers does, with their parameters.
ENGINE_ROPE_PARAMS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
ENGINE_AUX_LAYERS = AUX_LAYERS
SPECULATORS_LAYER_PREFIX = "layers.0."  # the speculators library's Eagle3DraftModel.layers[0]
_TARGET_FIELDS = ("name_or_path", "architecture", "model_type", "hidden_size", "num_layers", "vocab_size",
                  "max_position_embeddings")
_HUB_KEYS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder")
TensorSpec = dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, "float" | "int64" | "bool")


@dataclass
class Artifact:
    """What one export writes: config.json, one safetensors file, and the weights file's name."""

    config: dict[str, Any]
    tensors: dict[str, Tensor]
    weights_file: str = "model.safetensors"


# ---------------------------------------------------------------------------------------- export


def export_head(
    head: DraftHead,
    out_dir: str | Path,
    fmt: str,
    *,
    target: PretrainedConfig | PreTrainedModel | None = None,
    dtype: torch.dtype | None = None,
    num_speculative_tokens: int = 3,
    max_position_embeddings: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``head`` in serving format ``fmt`` (see ``FORMATS``) to ``out_dir``, with a model card.

    ``target`` (optional) is checked against the head and fills in target facts the head lacks.
    ``dtype`` casts the floating-point weights (default: as they are). ``max_position_embeddings``
    defaults to the larger of the head's and the target's context. Refuses (``ValueError``) to write
    anything an engine would load wrong; ``out_dir`` must be empty unless ``overwrite``.
    """
    kind = _format_kind(fmt)
    if head.head_kind != kind:
        raise ValueError(f"format '{fmt}' exports {kind} heads, got a {head.head_kind} head")
    if target is not None:
        head.check_target(target)
    facts = _target_facts(head, target)
    context = max(head.config.max_position_embeddings if kind != "medusa" else 0, facts["max_position_embeddings"])
    options = {
        "dtype": dtype,
        "num_speculative_tokens": num_speculative_tokens,
        "max_position_embeddings": max_position_embeddings or context,
    }
    artifact = _BUILDERS[fmt](head, facts, options)
    _raise_problems(validate_artifact(artifact.config, artifact.tensors, fmt), f"refusing to export as '{fmt}'")

    out = Path(out_dir)
    _check_destination(out, head)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(artifact, staging)
        _write_card(head, staging, fmt, artifact.config)
        validate_export(staging, fmt)
        written = _read_tensors(staging / artifact.weights_file)
        changed = [name for name, tensor in artifact.tensors.items() if not torch.equal(written[name], tensor)]
        if changed:
            raise ValueError(f"{staging / artifact.weights_file}: tensors {changed} changed on disk")
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


# What a training run or a draftsmith head directory holds; an export holds none of these.
_RUN_MARKERS = ("checkpoints", "best", "metrics.jsonl", "config.yaml")
_HEAD_MODEL_TYPES = ("draftsmith_medusa", "draftsmith_eagle", "draftsmith_eagle3")


def _check_destination(out: Path, head: DraftHead) -> None:
    """Refuse an ``out`` that is, contains or lies inside the directory the head was loaded from, or that
    holds a training run or a draftsmith head: replacing it would lose the trained head."""
    source = getattr(head, "name_or_path", "") or ""
    target = out.resolve()
    if source and Path(source).is_dir():
        source_dir = Path(source).resolve()
        if target == source_dir or source_dir in target.parents or target in source_dir.parents:
            relation = "is" if target == source_dir else "lies inside" if source_dir in target.parents else "contains"
            raise ValueError(f"refusing to write the export to {out}: it {relation} the head's own directory "
                             f"{source}; choose an --out outside it")
    if not target.is_dir():
        return
    found = [name for name in _RUN_MARKERS if (target / name).exists()]
    config = target / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            model_type = None
        if model_type in _HEAD_MODEL_TYPES:
            found.append(f"a draftsmith head (config.json model_type={model_type})")
    if found:
        raise ValueError(f"refusing to write the export to {out}: it holds {', '.join(found)} of a training run or "
                         "head, which overwriting would delete; choose another --out")


def _format_kind(fmt: str) -> str:
    if fmt not in FORMAT_KINDS:
        raise ValueError(f"unknown format '{fmt}'; expected one of {list(FORMATS)}")
    return FORMAT_KINDS[fmt]


def _target_facts(head: DraftHead, target: PretrainedConfig | PreTrainedModel | None) -> dict[str, Any]:
    """The target facts recorded in the head, completed by ``target`` when given."""
    facts = {field: getattr(head.config, f"target_{field}") for field in _TARGET_FIELDS}
    if target is not None:
        facts.update({k: v for k, v in target_identity(target).items() if v})
    return facts


def _float_tensors(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Detached contiguous CPU copies; floating point ones cast to ``dtype`` (ids and masks never are)."""
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous().clone()  # clone: safetensors refuses shared storage
    return out


def _dtype_name(tensors: dict[str, Tensor]) -> str:
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


def _llama_layer_config(head: DraftHead, options: dict[str, Any]) -> dict[str, Any]:
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


def _provenance(head: DraftHead, fmt: str, facts: dict[str, Any]) -> dict[str, Any]:
    block: dict[str, Any] = {"format": fmt, "format_version": FORMAT_VERSION, "head_kind": head.head_kind,
                             "target": dict(facts)}
    if head.head_kind == "eagle3":
        block["aux_layer_ids"] = list(head.config.aux_layer_ids)
        block["aux_layer_convention"] = HF_CONVENTION
    return block


def _eagle3_tensors(head: Eagle3Head, options: dict[str, Any]) -> dict[str, Tensor]:
    cfg = head.config
    if len(cfg.aux_layer_ids) != ENGINE_AUX_LAYERS:
        raise ValueError(
            f"aux_layer_ids={cfg.aux_layer_ids} has {len(cfg.aux_layer_ids)} layers; vLLM and SGLang build the fc "
            f"for exactly {ENGINE_AUX_LAYERS} (fc input = 3 * target_hidden_size)"
        )
    return _float_tensors(head.state_dict(), options["dtype"])


def _eagle3_artifact(head: Eagle3Head, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """LlamaForCausalLMEagle3 directory read by vLLM, SGLang and TensorRT-LLM."""
    cfg = head.config
    tensors = _eagle3_tensors(head, options)
    dtype = _dtype_name(tensors)
    config = {
        "architectures": [EAGLE3_ARCHITECTURE],
        **_llama_layer_config(head, options),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "norm_before_residual": False,  # the residual is the un-normed hidden state
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    ids, layers = list(cfg.aux_layer_ids), facts["num_layers"]
    # On the engines' default ([2, L//2, L-3]) the fields are left out: every engine then computes the
    # same layers from the target itself, and no reader can misread a convention.
    if not layers or ids != engine_aux_layer_ids(layers):
        config["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM: HF convention
        config["eagle_config"] = {  # SGLang: "output of layer k", it adds 1
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "use_aux_hidden_state": True,
        }
    config[PROVENANCE_KEY] = _provenance(head, "vllm+sglang", facts)
    return Artifact(config, tensors)


def _speculators_artifact(head: Eagle3Head, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """vLLM speculators flavour: `vllm serve DIR` finds the verifier and the proposal length itself.

    The speculators library's ``Eagle3DraftModel`` names its decoder layer ``layers.0`` (vLLM accepts
    both names, the library only its own), so the layer is renamed from the public ``midlayer``.
    """
    cfg = head.config
    tensors = {SPECULATORS_LAYER_PREFIX + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v
               for k, v in _eagle3_tensors(head, options).items()}
    dtype = _dtype_name(tensors)
    if not facts["name_or_path"]:
        raise ValueError("the speculators format names its verifier: the head records no target_name_or_path; "
                         "pass target= (a config or model whose name_or_path is set)")
    tokens = options["num_speculative_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {tokens!r}")
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": _llama_layer_config(head, options),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "norm_before_residual": False,  # explicit: vLLM's speculators path defaults it to True
        "norm_before_fc": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "verifier": {"name_or_path": facts["name_or_path"],
                         "architectures": [facts["architecture"]] if facts["architecture"] else []},
        },
        "torch_dtype": dtype,
        "dtype": dtype,
        PROVENANCE_KEY: _provenance(head, "speculators", facts),
    }
    return Artifact(config, tensors)


def _eagle_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """EAGLE-1 as a plain one-layer Llama config; vLLM's method "eagle" names it EagleLlamaForCausalLM."""
    if head.config.fc_bias:
        raise ValueError("fc_bias=True: vLLM's EAGLE loader builds the fc without a bias and drops fc.bias, "
                         "so this head would run without it; retrain with fc_bias=False")
    tensors = _float_tensors(head.state_dict(), options["dtype"])
    dtype = _dtype_name(tensors)
    config = {"architectures": ["LlamaForCausalLM"], **_llama_layer_config(head, options), "torch_dtype": dtype,
              "dtype": dtype, PROVENANCE_KEY: _provenance(head, "eagle-vllm", facts)}
    return Artifact(config, tensors)


def _medusa_vllm_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    cfg = head.config
    tensors = _float_tensors(head.state_dict(), options["dtype"])  # names already follow vLLM's layout
    dtype = _dtype_name(tensors)
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
        PROVENANCE_KEY: _provenance(head, "medusa-vllm", facts),
    }
    return Artifact(config, tensors)


def _medusa_tgi_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    cfg = head.config
    if not facts["name_or_path"]:
        raise ValueError("TGI loads the base model from base_model_name_or_path: the head records no "
                         "target_name_or_path; pass target= (a config or model whose name_or_path is set)")
    state = head.state_dict()
    renamed = {}
    for i in range(cfg.num_heads):
        for j in range(cfg.num_layers):
            renamed[f"{i}.{j}.linear.weight"] = state[f"blocks.{i}.layers.{j}.weight"]
            renamed[f"{i}.{j}.linear.bias"] = state[f"blocks.{i}.layers.{j}.bias"]
        renamed[f"{i}.{cfg.num_layers}.weight"] = state[f"lm_heads.{i}.weight"]
    tensors = _float_tensors(renamed, options["dtype"])
    config = {
        # no "architectures": TGI then drops a Medusa speculator for anything but an MLP speculator
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": facts["name_or_path"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "torch_dtype": _dtype_name(tensors),
        PROVENANCE_KEY: _provenance(head, "medusa-tgi", facts),
    }
    return Artifact(config, tensors, weights_file="medusa_lm_head.safetensors")


_BUILDERS = {
    "vllm": _eagle3_artifact,
    "sglang": _eagle3_artifact,
    "speculators": _speculators_artifact,
    "eagle-vllm": _eagle_artifact,
    "medusa-vllm": _medusa_vllm_artifact,
    "medusa-tgi": _medusa_tgi_artifact,
}


def _write(artifact: Artifact, directory: Path) -> None:
    (directory / "config.json").write_text(json.dumps(artifact.config, indent=2) + "\n")
    save_file(artifact.tensors, str(directory / artifact.weights_file), metadata={"format": "pt"})


def _write_card(head: DraftHead, directory: Path, fmt: str, config: dict[str, Any]) -> None:
    """README.md stating the format, the engines and (EAGLE-3) the layer convention written."""
    from heads.card import model_card  # heads.card imports this module

    (directory / "README.md").write_text(model_card(head, fmt=fmt, export_config=config))


# ------------------------------------------------------------------------------------ validation


def validate_export(path: str | Path, fmt: str) -> None:
    """Check a directory in format ``fmt`` as its engine would read it; ``ValueError`` lists every problem."""
    _format_kind(fmt)
    directory = Path(path)
    config = _read_json(directory / "config.json")
    weights = "medusa_lm_head.safetensors" if fmt == "medusa-tgi" else "model.safetensors"
    tensors = _read_tensors(directory / weights)
    _raise_problems(validate_artifact(config, tensors, fmt), f"{directory} is not a valid '{fmt}' export")


def validate_artifact(config: dict[str, Any], tensors: dict[str, Tensor], fmt: str) -> list[str]:
    """Problems (empty when none) of a config + tensors pair in format ``fmt``."""
    if fmt in ("vllm", "sglang"):
        return _eagle3_problems(config, config, tensors)
    if fmt == "speculators":
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            return ["transformer_layer_config is missing (vLLM reads the layer shape from it)"]
        return _speculators_problems(config) + _eagle3_problems(layer, config, tensors)
    if fmt == "eagle-vllm":
        return _eagle_problems(config, tensors)
    if fmt == "medusa-vllm":
        return _medusa_vllm_problems(config, tensors)
    return _medusa_tgi_problems(config, tensors)


def _raise_problems(problems: list[str], what: str) -> None:
    if problems:
        raise ValueError(f"{what}:\n  - " + "\n  - ".join(problems))


def _expect(config: dict[str, Any], key: str, want: Any, problems: list[str], why: str = "") -> None:
    if config.get(key) != want:
        problems.append(f"config {key}={config.get(key)!r}, expected {want!r}" + (f" ({why})" if why else ""))


def _ints(config: dict[str, Any], keys: tuple[str, ...], problems: list[str]) -> dict[str, int] | None:
    values = {k: config.get(k) for k in keys}
    bad = [k for k, v in values.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        problems.append(f"config needs positive integers for {bad}, got {[values[k] for k in bad]}")
        return None
    return values  # type: ignore[return-value]


def _rope_problems(layer: dict[str, Any]) -> list[str]:
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


def _context_problems(shape: dict[str, int] | None, provenance: dict[str, Any]) -> list[str]:
    context = (provenance.get("target") or {}).get("max_position_embeddings") or 0
    if shape and shape["max_position_embeddings"] < context:
        return [f"max_position_embeddings={shape['max_position_embeddings']} is below the target's context "
                f"{context}; positions past it wreck acceptance"]
    return []


def _layer_spec(prefix: str, layer: dict[str, int], attn_in: int, attn_bias: bool, mlp_bias: bool) -> TensorSpec:
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


def _name_problems(expected: Iterable[str], tensors: Iterable[str], note: str = "") -> list[str]:
    """Missing and unexpected tensor names, sorted."""
    expected, tensors = set(expected), set(tensors)
    problems = []
    if missing := sorted(expected - tensors):
        problems.append(f"missing tensors {missing}")
    if extra := sorted(tensors - expected):
        problems.append(f"unexpected tensors {extra}" + (f" ({note})" if note else ""))
    return problems


def _tensor_problems(tensors: dict[str, Tensor], spec: TensorSpec, dtype: Any) -> list[str]:
    problems = _name_problems(spec, tensors, "engines skip unknown names silently")
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


def draft_vocab_problems(d2t: Tensor | None, t2d: Tensor | None, draft_vocab_size: int, vocab_size: int) -> list[str]:
    """Problems of an EAGLE-3 draft-vocab mapping: target_id = draft_id + d2t[draft_id], t2d marks them."""
    if draft_vocab_size == vocab_size:
        return [f"{name} present although draft_vocab_size == vocab_size == {vocab_size} (engines expect none)"
                for name, t in (("d2t", d2t), ("t2d", t2d)) if t is not None]
    if d2t is None or t2d is None:
        return [f"draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size} needs d2t and t2d "
                f"(without d2t the engines map draft ids to the first {draft_vocab_size} target ids)"]
    if (d2t.shape, d2t.dtype, t2d.shape, t2d.dtype) != ((draft_vocab_size,), torch.int64, (vocab_size,), torch.bool):
        return [f"d2t must be int64 ({draft_vocab_size},) and t2d bool ({vocab_size},); got {d2t.dtype} "
                f"{tuple(d2t.shape)} and {t2d.dtype} {tuple(t2d.shape)}"]
    ids = torch.arange(draft_vocab_size) + d2t
    problems = []
    if draft_vocab_size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        first = int((ids[1:] <= ids[:-1]).nonzero()[0, 0])
        problems.append(f"d2t: target ids arange(Vd) + d2t must increase strictly; draft ids {first}, {first + 1} "
                        f"map to {int(ids[first])}, {int(ids[first + 1])}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        problems.append(f"d2t: target ids span {int(ids.min())}..{int(ids.max())}, outside [0, {vocab_size})")
    if int(t2d.sum()) != draft_vocab_size:
        problems.append(f"t2d marks {int(t2d.sum())} tokens, draft_vocab_size is {draft_vocab_size}")
    elif not problems and not bool(t2d[ids].all()):
        problems.append("t2d disagrees with d2t: some target ids reached by d2t are not marked in t2d")
    return problems


def _eagle3_problems(layer: dict[str, Any], top: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    """EAGLE-3 checks shared by the flat (``layer is top``) and the speculators config."""
    problems: list[str] = []
    if layer is top:
        _expect(top, "architectures", [EAGLE3_ARCHITECTURE], problems)
    _expect(layer, "model_type", "llama", problems, "engines build the draft layer from a Llama config")
    _expect(layer, "num_hidden_layers", 1, problems)
    _expect(layer, "tie_word_embeddings", False, problems, "SGLang would use embed_tokens as lm_head")
    _expect(layer, "hidden_act", "silu", problems, "the engines' Llama MLP")
    for key, why in (("attention_bias", "SGLang builds qkv without bias"), ("mlp_bias", "SGLang's MLP has none")):
        if layer.get(key):
            problems.append(f"config {key}=true: {why} and would drop the biases silently")
    if top.get("norm_before_residual"):
        problems.append("norm_before_residual=true describes another head (draftsmith keeps the un-normed residual)")
    problems += _rope_problems(layer)
    shape = _ints(layer, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "max_position_embeddings", "vocab_size"), problems)
    sizes = _ints(top, ("draft_vocab_size", "target_hidden_size"), problems)
    provenance = top.get(PROVENANCE_KEY) or {}
    problems += _context_problems(shape, provenance)
    if shape and sizes and shape["hidden_size"] != sizes["target_hidden_size"]:
        problems.append(f"hidden_size={shape['hidden_size']} differs from target_hidden_size="
                        f"{sizes['target_hidden_size']}: the engines would need the head's own embed_tokens, "
                        "which draftsmith heads do not have")
    problems += _aux_id_problems(top, provenance, flat=layer is top)
    if not (shape and sizes):
        return problems
    vd, v, h = sizes["draft_vocab_size"], shape["vocab_size"], shape["hidden_size"]
    if vd > v:
        problems.append(f"draft_vocab_size={vd} exceeds vocab_size={v}")
        return problems
    layer_prefix = "midlayer." if layer is top else SPECULATORS_LAYER_PREFIX
    spec: TensorSpec = {
        "fc.weight": ((h, ENGINE_AUX_LAYERS * sizes["target_hidden_size"]), "float"),
        f"{layer_prefix}input_layernorm.weight": ((h,), "float"),
        f"{layer_prefix}hidden_norm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((vd, h), "float"),
        **_layer_spec(layer_prefix, shape, 2 * h, False, False),
    }
    if vd < v:
        spec.update({"d2t": ((vd,), "int64"), "t2d": ((v,), "bool")})
    problems += _tensor_problems(tensors, spec, top.get("torch_dtype"))
    problems += draft_vocab_problems(tensors.get("d2t"), tensors.get("t2d"), vd, v)
    return problems


def _aux_id_problems(top: dict[str, Any], provenance: dict[str, Any], flat: bool) -> list[str]:
    try:
        ids = aux_layer_ids_from_config(top)
    except ValueError as err:
        return [str(err)]
    recorded = provenance.get("aux_layer_ids")
    if ids is None:  # omitted: every engine captures its default [2, L//2, L-3] of the target
        layers = (provenance.get("target") or {}).get("num_layers") or 0
        if recorded is not None and (not layers or recorded != engine_aux_layer_ids(layers)):
            return [f"no layer ids written, so engines capture their default [2, L//2, L-3], but the head reads "
                    f"{recorded} (target layers: {layers or 'unknown'})"]
        return []
    problems = []
    if flat and ("eagle_aux_hidden_state_layer_ids" not in top or "eagle_config" not in top):
        problems.append("write both eagle_aux_hidden_state_layer_ids (vLLM) and eagle_config (SGLang), or neither; "
                        "an engine that finds none of its own field captures its default layers")
    if len(ids) != ENGINE_AUX_LAYERS:
        problems.append(f"aux layer ids {ids}: the engines capture exactly {ENGINE_AUX_LAYERS} layers")
    if flat and min(ids) < 1:
        problems.append(f"aux layer ids {ids} include 0 (the embeddings), which SGLang's and TensorRT-LLM's "
                        "'output of layer k' convention cannot express")
    if recorded is not None and recorded != ids:
        problems.append(f"config layer ids {ids} disagree with the head's aux_layer_ids {recorded}")
    return problems


def _speculators_problems(config: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    _expect(config, "speculators_model_type", "eagle3", problems)
    _expect(config, "architectures", ["Eagle3Speculator"], problems)
    if config.get("norm_before_residual") is not False:
        problems.append("norm_before_residual must be written as false (vLLM's speculators path defaults to true)")
    if not config.get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_aux_hidden_state_layer_ids must be written (vLLM's speculators path passes it on)")
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        problems.append(f"speculators_config.proposal_methods[0].speculative_tokens={tokens!r}, expected an int >= 1")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is empty (`vllm serve DIR` loads it as the target)")
    return problems


def _eagle_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    _expect(config, "architectures", ["LlamaForCausalLM"], problems, "vLLM's method eagle prefixes it with Eagle")
    _expect(config, "model_type", "llama", problems)
    _expect(config, "num_hidden_layers", 1, problems)
    _expect(config, "tie_word_embeddings", False, problems)
    _expect(config, "hidden_act", "silu", problems, "vLLM's Llama MLP")
    problems += _rope_problems(config)
    shape = _ints(config, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                           "head_dim", "max_position_embeddings", "vocab_size"), problems)
    problems += _context_problems(shape, config.get(PROVENANCE_KEY) or {})
    if "fc.bias" in tensors:
        problems.append("unexpected tensor fc.bias: vLLM's EAGLE fc has no bias and drops it silently")
    if shape:
        h = shape["hidden_size"]
        spec = {"fc.weight": ((h, 2 * h), "float"),
                **_layer_spec("layers.0.", shape, h, bool(config.get("attention_bias")), bool(config.get("mlp_bias")))}
        without_bias = {k: v for k, v in tensors.items() if k != "fc.bias"}  # reported above
        problems += _tensor_problems(without_bias, spec, config.get("torch_dtype"))
    return problems


def _medusa_vllm_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    _expect(config, "model_type", "medusa", problems)
    _expect(config, "architectures", ["MedusaModel"], problems)
    _expect(config, "medusa_fc_bias", True, problems, "otherwise vLLM skips the block biases")
    # vLLM's MedusaConfig.from_pretrained renames every top-level key containing "num" and "heads"/"layers"
    clashing = [k for k in config if "num" in k and ("heads" in k or "layers" in k)
                and k not in ("num_heads", "num_hidden_layers")]
    if clashing:
        problems.append(f"top-level keys {clashing} would be renamed to num_heads/num_hidden_layers by vLLM")
    sizes = _ints(config, ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers", "truncated_vocab_size"),
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
    return problems + _tensor_problems(tensors, spec, config.get("torch_dtype"))


def _medusa_tgi_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    if "architectures" in config:
        problems.append("config has 'architectures': TGI then treats the speculator as non-Medusa and drops it")
    if not config.get("base_model_name_or_path"):
        problems.append("base_model_name_or_path is empty (TGI loads the target from it)")
    sizes = _ints(config, ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"), problems)
    if not sizes:
        return problems
    h, v, n = sizes["hidden_size"], sizes["vocab_size"], sizes["medusa_num_layers"]
    spec: TensorSpec = {}
    for i in range(sizes["medusa_num_heads"]):
        for j in range(n):
            spec[f"{i}.{j}.linear.weight"] = ((h, h), "float")
            spec[f"{i}.{j}.linear.bias"] = ((h,), "float")
        spec[f"{i}.{n}.weight"] = ((v, h), "float")
    return problems + _tensor_problems(tensors, spec, config.get("torch_dtype"))


# --------------------------------------------------------------------------------------- import


def aux_layer_ids_from_config(config: dict[str, Any], num_layers: int = 0) -> list[int] | None:
    """EAGLE-3 aux layers as HF hidden_states indices, from either engine convention.

    Top-level ``eagle_aux_hidden_state_layer_ids`` (vLLM, speculators) is already in HF terms;
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang, "output of layer k") gets +1. With
    neither, the engines' default ``[2, L//2, L-3]`` when ``num_layers`` is known, else None.
    """
    top = config.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = config.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError("eagle_config.use_aux_hidden_state=false: this draft reads no aux layers (not EAGLE-3)")
    nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    from_nested = [int(i) + 1 for i in nested] if nested else None
    if top and from_nested and [int(i) for i in top] != from_nested:
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids={list(top)} (entering layer k) and eagle_config."
            f"eagle_aux_hidden_state_layer_ids={list(nested)} (output of layer k) name different layers"
        )
    if top:
        return [int(i) for i in top]
    if from_nested:
        return from_nested
    return engine_aux_layer_ids(num_layers) if num_layers else None


def import_eagle3(
    path_or_repo: str | Path,
    *,
    target: PretrainedConfig | PreTrainedModel | str | None = None,
    allow_embed_tokens: bool = False,
    dtype: torch.dtype | None = None,
    **hub_kwargs: Any,
) -> Eagle3Head:
    """An ``Eagle3Head`` from a public EAGLE-3 checkpoint (EAGLE authors, SpecForge, speculators, our exports).

    ``target`` (config, model, or path/hub id of one) fills the target identity a public checkpoint
    lacks and is checked against it; it is needed when the config names no aux layers. A checkpoint's
    ``embed_tokens.weight`` is refused unless ``allow_embed_tokens`` (then dropped; compared with the
    target's embedding when ``target`` is a model). Weights keep their dtype unless ``dtype`` is given.
    ``hub_kwargs``: revision, token, cache_dir, local_files_only, force_download, subfolder.
    """
    unknown = sorted(set(hub_kwargs) - set(_HUB_KEYS))
    if unknown:
        raise TypeError(f"import_eagle3() got unexpected arguments {unknown}; hub arguments are {list(_HUB_KEYS)}")
    directory = _resolve_directory(path_or_repo, hub_kwargs)
    config = _read_json(directory / "config.json")
    speculators = config.get("speculators_model_type") is not None
    if speculators and config["speculators_model_type"] != "eagle3":
        raise ValueError(f"{directory}: speculators_model_type={config['speculators_model_type']!r}, not eagle3")
    layer = config.get("transformer_layer_config") if speculators else config
    if not isinstance(layer, dict):
        raise ValueError(f"{directory}/config.json: transformer_layer_config is missing")
    _refuse_variants(layer, config, directory)

    target_config = AutoConfig.from_pretrained(target) if isinstance(target, str) else target
    facts = _import_facts(config, layer, speculators)
    if target_config is not None:
        facts = _checked_target_facts(facts, target_config, directory)
    ids = aux_layer_ids_from_config(config, facts["num_layers"])
    if ids is None:
        raise ValueError(f"{directory}/config.json names no aux layers (eagle_aux_hidden_state_layer_ids); pass "
                         "target= so the engines' default [2, L//2, L-3] can be computed for the target's L layers")
    recorded = (config.get(PROVENANCE_KEY) or {}).get("aux_layer_ids")
    if recorded is not None and recorded != ids:
        raise ValueError(f"{directory}/config.json: layer ids {ids} disagree with the recorded aux_layer_ids "
                         f"{recorded}")

    vocab = _required(layer, "vocab_size", directory)
    head_config = Eagle3Config(
        hidden_size=_required(layer, "hidden_size", directory),
        intermediate_size=_required(layer, "intermediate_size", directory),
        num_attention_heads=_required(layer, "num_attention_heads", directory),
        num_key_value_heads=layer.get("num_key_value_heads"),
        head_dim=layer.get("head_dim"),
        hidden_act=layer.get("hidden_act", "silu"),
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        max_position_embeddings=_required(layer, "max_position_embeddings", directory),
        rope_config=_rope_config_from(layer, directory),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        vocab_size=vocab,
        draft_vocab_size=config.get("draft_vocab_size") or vocab,
        aux_layer_ids=ids,
        **{f"target_{k}": v for k, v in facts.items()},
    )
    head = Eagle3Head(head_config)
    target_model = target if isinstance(target, PreTrainedModel) else None
    tensors = _load_public_tensors(directory, allow_embed_tokens, target_model)
    _load_strict(head, tensors, directory)
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return head.to(dtype or (floats.pop() if len(floats) == 1 else torch.float32)).eval()


def _resolve_directory(path_or_repo: str | Path, hub_kwargs: dict[str, Any]) -> Path:
    path = Path(path_or_repo)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        download = {k: v for k, v in hub_kwargs.items() if k != "subfolder"}
        patterns = ["*.json", "*.safetensors", "*.bin"]
        path = Path(snapshot_download(str(path_or_repo), allow_patterns=patterns, **download))
    return path / hub_kwargs["subfolder"] if hub_kwargs.get("subfolder") else path


def _required(config: dict[str, Any], key: str, directory: Path) -> Any:
    if config.get(key) is None:
        raise ValueError(f"{directory}/config.json has no {key}")
    return config[key]


def _refuse_variants(layer: dict[str, Any], top: dict[str, Any], directory: Path) -> None:
    """Refuse EAGLE-3 variants a draftsmith head does not implement (they would load but draft wrong)."""
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{directory}: num_hidden_layers={layer['num_hidden_layers']}; draftsmith EAGLE-3 heads "
                         "have one layer")
    width, target_width = layer.get("hidden_size"), top.get("target_hidden_size")
    if target_width and width != target_width:
        raise ValueError(f"{directory}: hidden_size={width} differs from target_hidden_size={target_width}; such a "
                         "head needs its own embedding, and draftsmith heads use the target's")
    if layer.get("tie_word_embeddings"):
        raise ValueError(f"{directory}: tie_word_embeddings=true (lm_head = embedding) is not an EAGLE-3 draft head")
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if top.get(key) or layer.get(key):
            raise ValueError(f"{directory}: {key}=true is a variant draftsmith heads do not implement")


def _rope_config_from(layer: dict[str, Any], directory: Path) -> dict[str, Any]:
    """draftsmith's flat rope dict from v5 ``rope_parameters`` or legacy ``rope_theta``/``rope_scaling``."""
    legacy = dict(layer.get("rope_scaling") or {})
    legacy["rope_type"] = legacy.pop("type", legacy.get("rope_type", "default"))
    legacy["rope_theta"] = float(layer.get("rope_theta", 10000.0))
    params = layer.get("rope_parameters")
    if params and "rope_theta" not in params:
        raise ValueError(f"{directory}: per-layer-type rope_parameters {params} are not supported")
    rope = dict(params) if params else legacy
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(rope.get("rope_theta", legacy["rope_theta"]))
    if params and ("rope_theta" in layer or layer.get("rope_scaling")) and \
            (legacy["rope_type"], legacy["rope_theta"]) != (rope["rope_type"], rope["rope_theta"]):
        raise ValueError(f"{directory}: rope_parameters {params} disagree with rope_theta={layer.get('rope_theta')} "
                         f"/ rope_scaling={layer.get('rope_scaling')}")
    if rope["rope_type"] not in ENGINE_ROPE_PARAMS:
        raise ValueError(f"{directory}: rope_type '{rope['rope_type']}' is not supported (heads implement "
                         f"{sorted(ENGINE_ROPE_PARAMS)})")
    return rope


def _import_facts(config: dict[str, Any], layer: dict[str, Any], speculators: bool) -> dict[str, Any]:
    """Target facts the checkpoint states: ours record all of them, public ones only widths and vocab."""
    recorded = (config.get(PROVENANCE_KEY) or {}).get("target")
    if recorded:
        return {field: recorded.get(field) or ("" if field in ("name_or_path", "architecture", "model_type") else 0)
                for field in _TARGET_FIELDS}
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}) if speculators else {}
    return {
        "name_or_path": verifier.get("name_or_path") or "",
        "architecture": (verifier.get("architectures") or [""])[0],
        "model_type": "",
        "hidden_size": int(config.get("target_hidden_size") or layer.get("hidden_size") or 0),
        "num_layers": 0,  # unknown: a public checkpoint does not state the target's depth
        "vocab_size": int(layer.get("vocab_size") or 0),
        "max_position_embeddings": 0,
    }


def _checked_target_facts(facts: dict[str, Any], target: PretrainedConfig | PreTrainedModel,
                          directory: Path) -> dict[str, Any]:
    have = target_identity(target)
    problems = [f"{field}={facts[field]} (checkpoint) vs {field}={have[field]} (target)"
                for field in ("hidden_size", "num_layers", "vocab_size")
                if facts[field] and facts[field] != have[field]]
    if problems:
        raise ValueError(f"{directory} does not fit target '{have['name_or_path'] or have['architecture']}': "
                         + "; ".join(problems))
    return have


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return value


def _read_tensors(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except SafetensorError as err:
        raise ValueError(f"{path}: cannot read the weights ({err}); the file is incomplete or corrupt") from err


def _load_public_tensors(directory: Path, allow_embed_tokens: bool,
                         target: PreTrainedModel | None) -> dict[str, Tensor]:
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors or pytorch_model*.bin weights")
    tensors: dict[str, Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            raw = _read_tensors(file)
        else:  # the EAGLE authors publish pytorch_model.bin; weights_only refuses pickled code
            raw = torch.load(file, map_location="cpu", weights_only=True)
        for name, tensor in raw.items():
            # vLLM-style dumps prefix "model." and call the layer "layers.0"; the public layout is "midlayer"
            key = name.removeprefix("model.")
            key = "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key
            if key in tensors:
                raise ValueError(f"{directory}: tensor {key} appears twice (as {name} in {file.name})")
            tensors[key] = tensor
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None and not allow_embed_tokens:
        raise ValueError(f"{directory}: the checkpoint carries embed_tokens.weight {tuple(embed.shape)}; draftsmith "
                         "heads use the target's embedding. Pass allow_embed_tokens=True to drop it")
    if embed is not None and target is not None:
        mine = target.get_input_embeddings().weight.detach().float().cpu()
        # a bf16/fp16 copy of the target's embedding passes; a different embedding does not
        if mine.shape != embed.shape or not torch.allclose(mine, embed.float(), rtol=1e-2, atol=1e-2):
            raise ValueError(f"{directory}: embed_tokens.weight differs from the target's input embedding; the head "
                             "was trained with another embedding and would draft badly with the target's")
    return tensors


def _load_strict(head: Eagle3Head, tensors: dict[str, Tensor], directory: Path) -> None:
    cfg = head.config
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if not cfg.reduced_vocab:  # some checkpoints store the identity mapping; accept exactly that
        if d2t is not None and bool(d2t.any()):
            raise ValueError(f"{directory}: d2t is not all zeros although draft_vocab_size == vocab_size")
        if t2d is not None and not bool(t2d.all()):
            raise ValueError(f"{directory}: t2d is not all true although draft_vocab_size == vocab_size")
    else:
        if d2t is None:
            raise ValueError(f"{directory}: draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size} "
                             "but the checkpoint has no d2t")
        if t2d is None:  # derived from d2t: the two carry the same information
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[(torch.arange(cfg.draft_vocab_size) + d2t.long()).clamp(0, cfg.vocab_size - 1)] = True
        _raise_problems(draft_vocab_problems(d2t.long(), t2d.bool(), cfg.draft_vocab_size, cfg.vocab_size),
                        f"{directory}: bad draft vocabulary mapping")
        head.set_draft_vocab(torch.arange(cfg.draft_vocab_size) + d2t.long())
    expected = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    problems = _name_problems(expected, tensors)
    problems += [f"{name}: shape {tuple(tensors[name].shape)}, the config implies {tuple(expected[name].shape)}"
                 for name in sorted(set(expected) & set(tensors)) if tensors[name].shape != expected[name].shape]
    _raise_problems(problems, f"{directory} does not match its config.json")
    head.load_state_dict({**tensors, **{k: v for k, v in head.state_dict().items() if k in ("d2t", "t2d")}},
                         strict=True)
