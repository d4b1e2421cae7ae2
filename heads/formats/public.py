"""Import public EAGLE-3 checkpoints (EAGLE authors, SpecForge, speculators, our own exports) as heads."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from draftsmith.heads.common import target_identity
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.kinds import head_class
from draftsmith.heads.formats.eagle3 import aux_layer_ids_from_config, draft_vocab_problems
from draftsmith.heads.formats.variants.peagle import peagle_head_options
from draftsmith.data.base.torch_bin import read_torch_bin
from draftsmith.heads.formats.validation import (
    ENGINE_ROPE_PARAMS,
    PROVENANCE_KEY,
    _TARGET_FIELDS,
    name_problems,
    raise_problems,
    read_json_object,
    read_tensors,
)


_HUB_KEYS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder")


def import_eagle3(
    path_or_repo: str | Path,
    *,
    target: PretrainedConfig | PreTrainedModel | str | None = None,
    allow_embed_tokens: bool = False,
    dtype: torch.dtype | None = None,
    norm_output_meaning: str | None = None,
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
    config = read_json_object(directory / "config.json")
    speculators = config.get("speculators_model_type") is not None
    if speculators and config["speculators_model_type"] not in ("eagle3", "peagle"):
        raise ValueError(f"{directory}: speculators_model_type={config['speculators_model_type']!r}, not eagle3 "
                         "or peagle")
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
    norm_output = norm_output_of(config, norm_output_meaning, directory)
    variant = peagle_head_options(config, directory)
    cls = head_class("eagle3", variant.get("variant"))
    head_config = cls.config_class(
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
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=norm_output,
        **variant,
        **{f"target_{k}": v for k, v in facts.items()},
    )
    head = cls(head_config)
    target_model = target if isinstance(target, PreTrainedModel) else None
    ours = ((config.get(PROVENANCE_KEY) or {}).get("format") == "speculators")  # carries the target's embedding
    tensors = _load_public_tensors(directory, allow_embed_tokens or ours, target_model, head_config.mask_token_id)
    _load_strict(head, tensors, directory)
    floats = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return head.to(dtype or (floats.pop() if len(floats) == 1 else torch.float32)).eval()


NORM_OUTPUT_MEANINGS = ("post-norm", "specforge")


def norm_output_of(config: dict[str, Any], meaning: str | None, directory: Path) -> bool:
    """The head's ``norm_output`` for a checkpoint's config (docs/export-keys.md, "norm_output").

    vLLM, speculators, NeMo and SGLang (``"post-norm"``, draftsmith's meaning): true feeds ``norm(out)`` to the
    next step and to lm_head; default false. SpecForge (``"specforge"``): the next step always reads the
    pre-norm ``out``; true (its default) normalises the logits' input, false drops the final norm from the
    logits, which no draftsmith head computes. A flat config that writes the key and is not ours says
    neither, so the caller must name the meaning; absent, both mean plain EAGLE-3.
    """
    if meaning is not None and meaning not in NORM_OUTPUT_MEANINGS:
        raise ValueError(f"norm_output_meaning={meaning!r}; expected one of {list(NORM_OUTPUT_MEANINGS)}")
    if "norm_output" not in config:
        return False
    value = config["norm_output"]
    if not isinstance(value, bool):
        raise ValueError(f"{directory}/config.json: norm_output={value!r} must be true or false")
    known = PROVENANCE_KEY in config or config.get("speculators_model_type") is not None
    if meaning is None and not known:
        raise ValueError(f"{directory}/config.json: norm_output={str(value).lower()} means two things: vLLM, "
                         "speculators and NeMo feed the post-norm state forward, SpecForge the pre-norm one (and "
                         "with false drops the final norm from the logits); pass norm_output_meaning='specforge' "
                         "for a SpecForge checkpoint or 'post-norm' for the others")
    if meaning == "specforge":
        if not value:
            raise ValueError(f"{directory}/config.json: SpecForge's norm_output=false computes the logits without "
                             "the final norm, which a draftsmith head cannot express; it is refused")
        return False  # SpecForge's true: pre-norm state forward, normed logits = plain EAGLE-3
    return value


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
    for key in ("norm_before_residual", "norm_before_fc"):  # EAGLE-3.1's fc_norm and norm_output are read
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


def _load_public_tensors(directory: Path, allow_embed_tokens: bool, target: PreTrainedModel | None,
                         mask_row: int | None = None) -> dict[str, Tensor]:
    """The checkpoint's tensors under the head's names; P-EAGLE (``mask_row``): row ``mask_row`` of its
    ``embed_tokens.weight`` as ``mask_embedding`` (the rest of the table is the target's, checked when given)."""
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors or pytorch_model*.bin weights")
    tensors: dict[str, Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            raw = read_tensors(file)
        else:  # the EAGLE authors publish pytorch_model.bin: read without unpickling
            raw = read_torch_bin(file)
        for name, tensor in raw.items():
            # vLLM-style dumps prefix "model." and call the layer "layers.0"; the public layout is "midlayer"
            key = name.removeprefix("model.")
            key = "midlayer." + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key
            if key in tensors:
                raise ValueError(f"{directory}: tensor {key} appears twice (as {name} in {file.name})")
            tensors[key] = tensor
    embed = tensors.pop("embed_tokens.weight", None)
    if mask_row is not None:
        if embed is None:
            raise ValueError(f"{directory}: a peagle checkpoint carries its mask embedding as embed_tokens.weight row "
                             f"mask_token_id={mask_row}; it has no embed_tokens.weight")
        tensors["mask_embedding"] = embed[mask_row].clone()
        embed = torch.cat([embed[:mask_row], embed[mask_row + 1:]])
        allow_embed_tokens = True
    if embed is not None and not allow_embed_tokens:
        raise ValueError(f"{directory}: the checkpoint carries embed_tokens.weight {tuple(embed.shape)}; draftsmith "
                         "heads use the target's embedding. Pass allow_embed_tokens=True to drop it")
    if embed is not None and target is not None:
        mine = target.get_input_embeddings().weight.detach().float().cpu()
        if mask_row is not None:
            mine = torch.cat([mine[:mask_row], mine[mask_row + 1:]])
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
        raise_problems(draft_vocab_problems(d2t.long(), t2d.bool(), cfg.draft_vocab_size, cfg.vocab_size),
                        f"{directory}: bad draft vocabulary mapping")
        head.set_draft_vocab(torch.arange(cfg.draft_vocab_size) + d2t.long())
    expected = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    problems = name_problems(expected, tensors)
    problems += [f"{name}: shape {tuple(tensors[name].shape)}, the config implies {tuple(expected[name].shape)}"
                 for name in sorted(set(expected) & set(tensors)) if tensors[name].shape != expected[name].shape]
    raise_problems(problems, f"{directory} does not match its config.json")
    head.load_state_dict({**tensors, **{k: v for k, v in head.state_dict().items() if k in ("d2t", "t2d")}},
                         strict=True)
