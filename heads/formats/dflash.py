"""DFlash heads in z-lab's ``DFlashDraftModel`` layout (format ``dflash``), read by SGLang's
``--speculative-algorithm DFLASH`` and z-lab's own code; and public z-lab DFlash checkpoints imported.

The layout (docs/dflash.md, "Export"): a Qwen3-style config (``model_type: qwen3``, the draft's own
``num_hidden_layers``) with ``architectures: ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers``
and ``dflash_config: {target_layer_ids, mask_token_id}``, where ``target_layer_ids`` counts the *output*
of target layer k (draftsmith's HF indices minus 1); tensors ``fc``, ``hidden_norm``, ``layers.{i}.*``
(with per-head ``q_norm``/``k_norm``) and ``norm``, the names draftsmith's head already uses. The draft has
no embedding and no lm_head: both are the target's.

DFlash2 heads (``variant="dflash2"``) are written as z-lab's ``DFlash2DraftModel``, which SGLang's DFLASH
algorithm reads (docs/dflash.md, "DFlash2"): ``dflash_config`` adds ``conv_kernel_size``,
``conv_group_size``, ``selector_rank`` and ``selector_top_k``; tensors add ``layers.{i}.attention_conv`` /
``mlp_conv`` (``base_kernel`` (2, K, H), ``kernel_projection.weight`` (2·K·H/group, H)) and
``candidate_selector.{predecessor_codebook, successor_codebook}`` (V, r) (no ``.weight``, as z-lab's
checkpoints name them) and ``candidate_selector.hidden_projection.weight`` (r, H).

Domino heads (``variant="domino"``) are written as SpecForge's ``DominoDraftModel``, which SGLang's DFLASH reads
(docs/dflash.md, "Domino"): ``dflash_config`` adds ``projector_type: "domino"``, ``gru_hidden_dim``, ``emb_dim``,
``pure_draft_prefix_len`` and ``shift_label: true``; tensors add ``prefix_gru.weight_ih_l0`` (3G, H),
``prefix_gru.weight_hh_l0`` (3G, G), ``embed_proj.0.weight`` (E, H+G) and ``embed_proj.2.weight`` (V, E).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.heads.common import DraftHead
from draftsmith.heads.dflash import (DFLASH2_ARCHITECTURE, DFLASH2_DEFAULTS, DFLASH_ARCHITECTURE, DFlashHead,
                          build_target_layer_ids)
from draftsmith.heads.kinds import head_class
from draftsmith.heads.variants.domino import DOMINO_ARCHITECTURE, DOMINO_DEFAULTS, DOMINO_PROJECTOR
from draftsmith.heads.formats.public import _resolve_directory, _rope_config_from
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
    read_json_object,
    read_tensors,
    rope_problems,
    tensor_problems,
    _rope_fields,
)


def _dflash_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    cfg = head.config
    if cfg.is_dspark:
        raise ValueError("z-lab's DFlashDraftModel carries no DSpark (its slots draft from the first mask, and it has "
                         "no Markov or confidence head); export DSpark heads --to dspark (SGLang) or --to speculators")
    target_width = cfg.target_hidden_size or cfg.hidden_size
    if target_width != cfg.hidden_size:
        raise ValueError(f"hidden_size={cfg.hidden_size} differs from the target's {target_width}: DFlashDraftModel "
                         "sizes its fc for len(target_layer_ids) x its own hidden_size")
    if not facts["num_layers"]:
        raise ValueError("the dflash format records num_target_layers; the head names no target layer count "
                         "(pass target= / --target)")
    tensors = float_tensors(head.state_dict(), options["dtype"])
    dtype = dtype_name(tensors)
    dflash = {"target_layer_ids": [i - 1 for i in cfg.aux_layer_ids], "mask_token_id": cfg.mask_token_id}
    if cfg.is_dflash2:
        dflash.update({key: getattr(cfg, key) for key in DFLASH2_DEFAULTS})
    if cfg.is_domino:  # SpecForge's DominoDraftModel: slot k drafts a+k+1 (shift_label)
        dflash.update({"projector_type": DOMINO_PROJECTOR, **{key: getattr(cfg, key) for key in DOMINO_DEFAULTS},
                       "shift_label": True})
    architecture = {"dflash2": DFLASH2_ARCHITECTURE, "domino": DOMINO_ARCHITECTURE}.get(cfg.variant, DFLASH_ARCHITECTURE)
    config = {
        "architectures": [architecture],
        **qwen3_layers_config(head, options),
        "block_size": cfg.block_size,
        "num_target_layers": facts["num_layers"],
        "dflash_config": dflash,
        "torch_dtype": dtype,
        "dtype": dtype,
        PROVENANCE_KEY: provenance_record(head, "dflash", facts),
    }
    return Artifact(config, tensors)


def read_checkpoint(path_or_repo: str | Path, hub_kwargs: dict[str, Any]) -> tuple[Path, dict[str, Any], dict[str, Tensor]]:
    """(directory, config.json, every *.safetensors tensor) of a local or Hub checkpoint."""
    directory = _resolve_directory(path_or_repo, hub_kwargs)
    config = read_json_object(directory / "config.json")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights (pickled weights are never read)")
    tensors: dict[str, Tensor] = {}
    for file in files:
        tensors.update(read_tensors(file))
    return directory, config, tensors


DSPARK_RANK = "markov_rank"  # present (DeepSpec's key) when the layout holds a DSpark
UNKNOWN_TARGET_LAYERS = "_target_layers_unknown"  # set (in memory) for a layout that records no num_target_layers


def qwen3_layers_config(head: DraftHead, options: dict[str, Any]) -> dict[str, Any]:
    """The draft layers' config as DFlashDraftModel (z-lab, and the speculators library's
    ``transformer_layer_config``) builds them: Qwen3 layers (q_norm / k_norm per head), full attention."""
    layers = head.config.num_layers
    return {
        **llama_layer_config(head, options),
        "model_type": "qwen3",
        "num_hidden_layers": layers,
        "layer_types": ["full_attention"] * layers,  # z-lab's attention reads layer_types[layer_idx]
        "use_sliding_window": False,
        "sliding_window": None,
    }


def is_dflash2_layout(config: dict[str, Any]) -> bool:
    return config.get("architectures") == [DFLASH2_ARCHITECTURE]


def is_domino_layout(config: dict[str, Any]) -> bool:
    return config.get("architectures") == [DOMINO_ARCHITECTURE]


# SGLang's DFLASH takes "causal_v5" as another name of the Domino projector; SpecForge fills in "domino" when absent
DOMINO_PROJECTORS = (None, DOMINO_PROJECTOR, "causal_v5")


def _domino_spec(dflash: dict[str, Any], shape: dict[str, int], problems: list[str]) -> dict:
    """Domino's extra tensors, from its ``dflash_config`` fields (each problem listed)."""
    if dflash.get("projector_type") not in DOMINO_PROJECTORS:
        problems.append(f"dflash_config.projector_type={dflash['projector_type']!r}: DominoDraftModel requires 'domino'")
    if dflash.get("shift_label") is not True:
        problems.append(f"dflash_config.shift_label={dflash.get('shift_label')!r}: draftsmith's Domino drafts slot k "
                        "as the token k+1 after the anchor (shift_label true, the shipped configs'); false is not built")
    sizes = ints(dflash, ("gru_hidden_dim", "emb_dim"), problems)
    prefix = dflash.get("pure_draft_prefix_len", 0)  # SpecForge's default when absent
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 0 <= prefix < shape["block_size"]:
        problems.append(f"dflash_config.pure_draft_prefix_len={prefix!r} must lie in 0..block_size - 1")
    if not sizes:
        return {}
    h, v, g, e = shape["hidden_size"], shape["vocab_size"], sizes["gru_hidden_dim"], sizes["emb_dim"]
    return {"prefix_gru.weight_ih_l0": ((3 * g, h), "float"), "prefix_gru.weight_hh_l0": ((3 * g, g), "float"),
            "embed_proj.0.weight": ((e, h + g), "float"), "embed_proj.2.weight": ((v, e), "float")}


def _dflash2_spec(dflash: dict[str, Any], shape: dict[str, int], problems: list[str]) -> dict:
    """DFlash2's extra tensors, from its ``dflash_config`` fields (each problem listed)."""
    sizes = ints(dflash, tuple(DFLASH2_DEFAULTS), problems)
    for key in ("output_multiplier", "final_logit_softcapping"):  # z-lab's optional unary-logit transforms
        if dflash.get(key) not in (None, 1.0 if key == "output_multiplier" else 0.0):
            problems.append(f"dflash_config.{key}={dflash[key]!r}: draftsmith's DFlash2 reads the target's "
                            "logits unchanged")
    if not sizes:
        return {}
    h, v, rank = shape["hidden_size"], shape["vocab_size"], sizes["selector_rank"]
    if h % sizes["conv_group_size"]:
        problems.append(f"dflash_config.conv_group_size={sizes['conv_group_size']} does not divide hidden_size={h}")
        return {}
    kernel = sizes["conv_kernel_size"]
    spec = {"candidate_selector.predecessor_codebook": ((v, rank), "float"),
            "candidate_selector.successor_codebook": ((v, rank), "float"),
            "candidate_selector.hidden_projection.weight": ((rank, h), "float")}
    for i in range(shape["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            spec[f"layers.{i}.{conv}.base_kernel"] = ((2, kernel, h), "float")
            spec[f"layers.{i}.{conv}.kernel_projection.weight"] = ((2 * kernel * (h // sizes["conv_group_size"]), h),
                                                                  "float")
    return spec


def dspark_spec(rank: Any, shape: dict[str, int], problems: list[str]) -> dict:
    """DSpark's extra tensors for a ``markov_rank`` (DeepSpec's names, read by speculators, vLLM and SGLang)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"markov_rank={rank!r} must be a positive integer (DSpark's Markov head)")
        return {}
    h, v = shape["hidden_size"], shape["vocab_size"]
    return {"markov_head.markov_w1.weight": ((v, rank), "float"), "markov_head.markov_w2.weight": ((v, rank), "float"),
            "confidence_head.proj.weight": ((1, h + rank), "float"), "confidence_head.proj.bias": ((1,), "float")}


def _dflash_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    if not is_dflash2_layout(config) and not is_domino_layout(config):
        expect(config, "architectures", [DFLASH_ARCHITECTURE], problems,
               f"or [{DFLASH2_ARCHITECTURE!r}] or [{DOMINO_ARCHITECTURE!r}]")
    expect(config, "model_type", "qwen3", problems, "DFlashDraftModel builds Qwen3 layers")
    expect(config, "tie_word_embeddings", False, problems)
    expect(config, "hidden_act", "silu", problems, "the Qwen3 MLP")
    if config.get("mlp_bias"):
        problems.append("config mlp_bias=true: the Qwen3 MLP has no biases and would drop them")
    problems += rope_problems(config)
    known_target = config.get("num_target_layers") is not None or config.get(UNKNOWN_TARGET_LAYERS) is not True
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "vocab_size", "num_hidden_layers", "block_size")
    shape = ints(config, fields + (("num_target_layers",) if known_target else ()), problems)
    problems += context_problems(shape, config.get(PROVENANCE_KEY) or {})
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        return problems + ["dflash_config is missing (it names target_layer_ids and mask_token_id)"]
    ids, mask = dflash.get("target_layer_ids"), dflash.get("mask_token_id")
    if not shape:
        return problems
    if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        problems.append(f"dflash_config.target_layer_ids={ids!r} must be a non-empty list of layer ids")
        ids = None
    elif any(i < 0 for i in ids) or (known_target and any(i >= shape["num_target_layers"] for i in ids)):
        top = shape["num_target_layers"] - 1 if known_target else "L-1"
        problems.append(f"dflash_config.target_layer_ids={ids} must lie in 0..{top}")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < shape["vocab_size"]:
        problems.append(f"dflash_config.mask_token_id={mask!r} must be a token id in 0..{shape['vocab_size'] - 1}")
    if shape["block_size"] < 2:
        problems.append(f"block_size={shape['block_size']}: a block needs the root and one mask")
    if ids is None:
        return problems
    h, d = shape["hidden_size"], shape["head_dim"]
    spec = {"fc.weight": ((h, len(ids) * h), "float"), "hidden_norm.weight": ((h,), "float"),
            "norm.weight": ((h,), "float")}
    for i in range(shape["num_hidden_layers"]):
        prefix = f"layers.{i}."
        spec.update(layer_spec(prefix, shape, h, bool(config.get("attention_bias")), False))
        spec.update({f"{prefix}input_layernorm.weight": ((h,), "float"),
                     f"{prefix}self_attn.q_norm.weight": ((d,), "float"),
                     f"{prefix}self_attn.k_norm.weight": ((d,), "float")})
    if is_dflash2_layout(config):
        spec.update(_dflash2_spec(dflash, shape, problems))
    if is_domino_layout(config):
        spec.update(_domino_spec(dflash, shape, problems))
    if DSPARK_RANK in config:  # a DSpark seen as this layout (formats.variants.dspark, speculators' dspark type)
        spec.update(dspark_spec(config[DSPARK_RANK], shape, problems))
    problems += tensor_problems(tensors, spec, config.get("torch_dtype"))
    return problems


def import_dflash(path_or_repo: str | Path, *, dtype: torch.dtype | None = None, **hub_kwargs: Any) -> DFlashHead:
    """A ``DFlashHead`` from a ``DFlashDraftModel`` directory or Hub id (z-lab's published drafters, our
    exports). Its config must name ``dflash_config.mask_token_id`` (SGLang's alternative, a mask token
    *string* looked up in the tokenizer, is refused: a head stores ids). Every tensor is checked as for
    an export. ``hub_kwargs`` as ``import_eagle3``'s."""
    directory, config, tensors = read_checkpoint(path_or_repo, hub_kwargs)
    dflash = config.get("dflash_config") if isinstance(config.get("dflash_config"), dict) else {}
    if dflash.get("mask_token_id") is None:
        raise ValueError(f"{directory}/config.json: dflash_config names no mask_token_id (a mask token string "
                         f"{dflash.get('mask_token')!r} needs the tokenizer); add the id to dflash_config")
    layers, target_layers = config.get("num_hidden_layers"), config.get("num_target_layers")
    if "target_layer_ids" not in dflash and isinstance(target_layers, int) and isinstance(layers, int):
        dflash = {**dflash, "target_layer_ids": build_target_layer_ids(target_layers, layers)}  # z-lab's default
    return head_from_layout({**config, "dflash_config": dflash}, tensors, directory, dtype,
                            config["architectures"][0] if is_dflash2_layout(config) or is_domino_layout(config)
                            else DFLASH_ARCHITECTURE)


def head_from_layout(config: dict[str, Any], tensors: dict[str, Tensor], directory: Path, dtype: torch.dtype | None,
                     what: str) -> DFlashHead:
    """A DFlash head (or its variant's) from a config in z-lab's layout (``dflash_config`` with ``target_layer_ids``
    and ``mask_token_id``) and its tensors, every problem listed; ``what`` names the layout in the error."""
    dflash = config["dflash_config"]
    layers, target_layers = config.get("num_hidden_layers"), config.get("num_target_layers")
    rope = _rope_config_from(config, directory)  # z-lab's configs write rope_theta only: read as ours would be
    problems = _dflash_problems({**config, **_rope_fields(rope)}, tensors)
    if problems:
        raise ValueError(f"{directory} is not a {what} draftsmith can load:\n  - " + "\n  - ".join(problems))
    cls = head_class("dflash", (variant := _variant_options(config)).get("variant"))
    head_config = cls.config_class(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"], hidden_act="silu", rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config["max_position_embeddings"], rope_config=rope,
        attention_bias=bool(config.get("attention_bias", False)), vocab_size=config["vocab_size"],
        block_size=config["block_size"], num_layers=layers,
        aux_layer_ids=[i + 1 for i in dflash["target_layer_ids"]], mask_token_id=dflash["mask_token_id"],
        target_hidden_size=config["hidden_size"], target_num_layers=target_layers, target_vocab_size=config["vocab_size"],
        **_recorded_target(config), **variant,
    )
    head = cls(head_config)
    head.load_state_dict(tensors, strict=True)  # names and shapes were checked above
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return head.to(dtype or (floats.pop() if len(floats) == 1 else torch.float32)).eval()


def _variant_options(config: dict[str, Any]) -> dict[str, Any]:
    """The variant keys a layout's config names: DFlash2's shape, DSpark's Markov rank, Domino's shape."""
    if is_dflash2_layout(config):
        return {"variant": "dflash2", **{k: config["dflash_config"][k] for k in DFLASH2_DEFAULTS}}
    if is_domino_layout(config):
        return {"variant": "domino", **{k: config["dflash_config"].get(k, 0) for k in DOMINO_DEFAULTS}}
    return {"variant": "dspark", "markov_rank": config[DSPARK_RANK]} if DSPARK_RANK in config else {}


def _recorded_target(config: dict[str, Any]) -> dict[str, Any]:
    """The target identity our own exports record (public checkpoints record none)."""
    target = (config.get(PROVENANCE_KEY) or {}).get("target") or {}
    keys = ("name_or_path", "architecture", "model_type", "max_position_embeddings")
    return {f"target_{k}": target[k] for k in keys if target.get(k)}
