"""EAGLE-3 as ``LlamaForCausalLMEagle3`` (formats ``vllm``/``sglang``): one directory read by vLLM, SGLang
and TensorRT-LLM; its validator; the aux-layer conventions of each engine; the draft-vocab mapping."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from draftsmith.heads.eagle3 import SGLANG_UNREAD, Eagle3Head, engine_aux_layer_ids
from draftsmith.heads.formats.validation import (
    Artifact,
    EAGLE3_ARCHITECTURE,
    ENGINE_AUX_LAYERS,
    PROVENANCE_KEY,
    TensorSpec,
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


def eagle31_flags(cfg, flat: bool = False) -> dict[str, bool]:
    """EAGLE-3.1's flags as vLLM (LlamaForCausalLMEagle3) and speculators read them, written explicitly so no
    reader's default decides. In the flat (``vllm``/``sglang``) config a false ``norm_output`` is left out:
    SpecForge, which trains for SGLang, reads an explicit false as "logits without the final norm" and its
    default (true) as plain EAGLE-3, while vLLM's and SGLang's default (false) is plain EAGLE-3 too."""
    flags = {"fc_norm": bool(cfg.fc_norm), "norm_output": bool(cfg.norm_output)}
    if flat and not cfg.norm_output:
        del flags["norm_output"]
    return flags


def _eagle3_tensors(head: Eagle3Head, options: dict[str, Any]) -> dict[str, Tensor]:
    cfg = head.config
    if len(cfg.aux_layer_ids) != ENGINE_AUX_LAYERS:
        raise ValueError(
            f"aux_layer_ids={cfg.aux_layer_ids} has {len(cfg.aux_layer_ids)} layers; vLLM and SGLang build the fc "
            f"for exactly {ENGINE_AUX_LAYERS} (fc input = 3 * target_hidden_size)"
        )
    return float_tensors(head.state_dict(), options["dtype"])


def _eagle3_artifact(head: Eagle3Head, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """LlamaForCausalLMEagle3 directory read by vLLM, SGLang and TensorRT-LLM."""
    cfg = head.config
    if cfg.is_peagle:
        raise ValueError("the vllm/sglang layout carries no P-EAGLE (no mask_hidden, no mask token); export "
                         "head.variant=peagle heads --to speculators (speculators_model_type: peagle, read by vLLM)")
    tensors = _eagle3_tensors(head, options)
    dtype = dtype_name(tensors)
    config = {
        "architectures": [EAGLE3_ARCHITECTURE],
        **llama_layer_config(head, options),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "norm_before_residual": False,  # the residual is the un-normed hidden state
        **eagle31_flags(cfg, flat=True),
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
    config[PROVENANCE_KEY] = provenance_record(head, "vllm+sglang", facts)
    return Artifact(config, tensors)


def _sglang_eagle3_artifact(head: Eagle3Head, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """``--to sglang``: the ``vllm`` directory, refused for a head that SGLang's reader decodes as another head."""
    unread = [key for key in SGLANG_UNREAD if getattr(head.config, key)]
    if unread:
        raise ValueError(
            f"refusing to export as 'sglang': the head sets {' and '.join(f'{k}=true' for k in unread)} (EAGLE-3.1), "
            "which SGLang's LlamaForCausalLMEagle3 (commit d737979, docs/export-keys.md) does not read: it would decode "
            "a plain EAGLE-3 head from these weights. Export --to vllm or --to speculators (an SGLang version that "
            "reads the flags takes the --to vllm directory), or train with "
            + " ".join(f"head.{k}=false" for k in unread) + " for SGLang")
    return _eagle3_artifact(head, facts, options)


def _eagle3_problems(layer: dict[str, Any], top: dict[str, Any], tensors: dict[str, Tensor],
                     layer_prefix: str = "midlayer.") -> list[str]:
    """EAGLE-3 checks shared by the flat (``layer is top``) and the speculators config; the decoder layer's
    tensors are named ``layer_prefix*``."""
    problems: list[str] = []
    if layer is top:
        expect(top, "architectures", [EAGLE3_ARCHITECTURE], problems)
    expect(layer, "model_type", "llama", problems, "engines build the draft layer from a Llama config")
    expect(layer, "num_hidden_layers", 1, problems)
    expect(layer, "tie_word_embeddings", False, problems, "SGLang would use embed_tokens as lm_head")
    expect(layer, "hidden_act", "silu", problems, "the engines' Llama MLP")
    for key, why in (("attention_bias", "SGLang builds qkv without bias"), ("mlp_bias", "SGLang's MLP has none")):
        if layer.get(key):
            problems.append(f"config {key}=true: {why} and would drop the biases silently")
    if layer is top and top.get("norm_output") is False:
        problems.append("norm_output=false written: SpecForge reads it as logits without the final norm; leave it "
                        "out (every reader's default is then plain EAGLE-3)")
    if top.get("norm_before_residual"):
        problems.append("norm_before_residual=true describes another head (draftsmith keeps the un-normed residual)")
    if top.get("norm_before_fc"):
        problems.append("norm_before_fc=true (one norm over the concatenated features) describes another head; "
                        "EAGLE-3.1's per-layer norms are fc_norm")
    problems += rope_problems(layer)
    shape = ints(layer, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "max_position_embeddings", "vocab_size"), problems)
    sizes = ints(top, ("draft_vocab_size", "target_hidden_size"), problems)
    provenance = top.get(PROVENANCE_KEY) or {}
    problems += context_problems(shape, provenance)
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
    spec: TensorSpec = {
        "fc.weight": ((h, ENGINE_AUX_LAYERS * sizes["target_hidden_size"]), "float"),
        f"{layer_prefix}input_layernorm.weight": ((h,), "float"),
        f"{layer_prefix}hidden_norm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((vd, h), "float"),
        **layer_spec(layer_prefix, shape, 2 * h, False, False),
    }
    if vd < v:
        spec.update({"d2t": ((vd,), "int64"), "t2d": ((v,), "bool")})
    if top.get("fc_norm"):  # EAGLE-3.1: one norm per fused target layer, before fc
        spec.update({f"fc_norm.{i}.weight": ((sizes["target_hidden_size"],), "float") for i in range(ENGINE_AUX_LAYERS)})
    problems += tensor_problems(tensors, spec, top.get("torch_dtype"))
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
