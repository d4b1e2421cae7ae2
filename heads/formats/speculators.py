"""vLLM's speculators flavour (format ``speculators``): ``vllm serve DIR`` finds the verifier and proposal
length in the config. EAGLE-3 heads: ``speculators_model_type: eagle3``, the layer ``layers.0.*`` as in the
speculators library's checkpoints. DFlash heads: ``speculators_model_type: dflash`` (the library's
``DFlashSpeculatorConfig``; vLLM's ``update_dflash`` turns it into a ``DFlashDraftModel`` config with
``dflash_config.target_layer_ids`` = ``aux_hidden_state_layer_ids`` − 1); tensors as z-lab's layout.

What each reader takes from these configs (with file and line) is tabled in docs/export-keys.md."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.heads.common import DraftHead
from draftsmith.heads.dflash import DFLASH_ARCHITECTURE, DFlashHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.formats.eagle3 import _eagle3_problems, _eagle3_tensors, eagle31_flags
from draftsmith.heads.formats.variants.dspark import dspark_fields
from draftsmith.heads.formats.variants.peagle import as_eagle3, peagle_problems, to_peagle
from draftsmith.heads.formats.dflash import (DSPARK_RANK, UNKNOWN_TARGET_LAYERS, _dflash_problems, head_from_layout, qwen3_layers_config,
                                  read_checkpoint)
from draftsmith.heads.formats.validation import (Artifact, PROVENANCE_KEY, dtype_name, expect, expect_tensor, float_tensors, llama_layer_config,
                                      provenance_record)


SPECULATORS_LAYER_PREFIX = "layers.0."  # the speculators library's Eagle3DraftModel.layers[0]


EMBED_TOKENS = "embed_tokens.weight"  # the target's input embedding, written into speculators EAGLE-3 exports


DFLASH_SPECULATOR = "DFlashSpeculator"  # the speculators library's architectures entry for dflash
DSPARK_SPECULATOR = "DSparkSpeculator"  # and for dspark (DSparkSpeculatorConfig)
DFLASH_TYPES = {"dflash": DFLASH_SPECULATOR, "dspark": DSPARK_SPECULATOR}


def _speculators_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """The speculators flavour of an EAGLE-3 or a DFlash head."""
    if head.head_kind == "dflash":
        return _speculators_dflash_artifact(head, facts, options)
    artifact = _speculators_eagle3_artifact(head, facts, options)
    return to_peagle(head, artifact, options) if head.config.is_peagle else artifact


def _verifier(facts: dict[str, Any]) -> dict[str, Any]:
    """``speculators_config.verifier``: the target by Hub id (``vllm serve DIR`` loads it)."""
    if not facts["name_or_path"]:
        raise ValueError("the speculators format names its verifier: the head records no target by Hub id (a "
                         "local path is not written into exports unless given); pass verifier= (--verifier) the "
                         "target's Hub id or path, or target= (--target) a config whose name_or_path is its Hub id")
    return {"name_or_path": facts["name_or_path"], "architectures": [facts["architecture"]] if facts["architecture"] else []}


def _proposals(algorithm: str, tokens: int, facts: dict[str, Any]) -> dict[str, Any]:
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}], "verifier": _verifier(facts)}


def _speculators_eagle3_artifact(head: Eagle3Head, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """vLLM speculators flavour: `vllm serve DIR` finds the verifier and the proposal length itself.

    The speculators library's ``Eagle3DraftModel`` names its decoder layer ``layers.0`` (vLLM accepts
    both names, the library only its own), so the layer is renamed from the public ``midlayer``.
    """
    cfg = head.config
    tensors = {SPECULATORS_LAYER_PREFIX + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v
               for k, v in _eagle3_tensors(head, options).items()}
    _verifier(facts)  # its own message first: a head of a local target names none
    embedding = options.get("embedding")
    if embedding is None:
        raise ValueError("the speculators format carries the target's embed_tokens.weight (speculators' "
                         "Eagle3DraftModel fills it from the verifier only while it is NaN, and its from_pretrained "
                         "leaves it uninitialised): pass target= the target model (--target)")
    if tuple(embedding.shape) != (cfg.vocab_size, cfg.target_hidden_size or cfg.hidden_size):
        raise ValueError(f"the target's input embedding is {tuple(embedding.shape)}, the head expects "
                         f"({cfg.vocab_size}, {cfg.target_hidden_size or cfg.hidden_size})")
    # (V, H) the target's own rows: vLLM and the library then embed draft tokens exactly as training did
    dtype = options["dtype"] or tensors["fc.weight"].dtype
    tensors[EMBED_TOKENS] = float_tensors({EMBED_TOKENS: embedding}, dtype)[EMBED_TOKENS]
    dtype = dtype_name(tensors)
    tokens = options["num_speculative_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {tokens!r}")
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": llama_layer_config(head, options),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "norm_before_residual": False,  # explicit: vLLM's speculators path defaults it to True
        "norm_before_fc": False,
        **eagle31_flags(cfg),
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": _proposals("eagle3", tokens, facts),
        "torch_dtype": dtype,
        "dtype": dtype,
        PROVENANCE_KEY: provenance_record(head, "speculators", facts),
    }
    return Artifact(config, tensors)


def _speculators_problems(config: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    expect(config, "speculators_model_type", "eagle3", problems)
    expect(config, "architectures", ["Eagle3Speculator"], problems)
    problems += _speculators_config_problems(config)
    if config.get("norm_before_residual") is not False:
        problems.append("norm_before_residual must be written as false (vLLM's speculators path defaults to true)")
    if not config.get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_aux_hidden_state_layer_ids must be written (vLLM's speculators path passes it on)")
    return problems


def _speculators_config_problems(config: dict[str, Any]) -> list[str]:
    """``speculators_config``: one greedy proposal method with its token count, and the verifier."""
    problems: list[str] = []
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        problems.append(f"speculators_config.proposal_methods[0].speculative_tokens={tokens!r}, expected an int >= 1")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is empty (`vllm serve DIR` loads it as the target)")
    return problems


def _speculators_dflash_artifact(head: DFlashHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """The speculators library's ``DFlashSpeculatorConfig`` layout. Its tensors are z-lab's names (``fc``,
    ``hidden_norm``, ``layers.{i}.*``, ``norm``); no embedding or lm_head: vLLM shares the target's, as
    for z-lab's drafters (the library itself reloads both from the verifier when it trains)."""
    cfg = head.config
    if getattr(cfg, "is_dflash2", False):
        raise ValueError("the speculators format carries no DFlash2 (vLLM's update_dflash reads no convolution or "
                         "selector); export DFlash2 heads --to dflash (z-lab's DFlash2DraftModel, read by SGLang)")
    if getattr(cfg, "is_domino", False):
        raise ValueError("the speculators format carries no Domino (the upstream library has no domino type); export "
                         "Domino heads --to dflash (SpecForge's DominoDraftModel, read by SGLang's DFLASH)")
    if (cfg.target_hidden_size or cfg.hidden_size) != cfg.hidden_size:
        raise ValueError(f"hidden_size={cfg.hidden_size} differs from the target's {cfg.target_hidden_size}: "
                         "the DFlash fc takes len(aux layers) x its own hidden_size")
    tensors = float_tensors(head.state_dict(), options["dtype"])
    dtype = dtype_name(tensors)
    # DSpark: speculators' DSparkSpeculatorConfig fields; vLLM's config starts from transformer_layer_config
    # (base.py) and its qwen3_dspark.py reads the confidence keys from there, so they are written there too
    dspark = dspark_fields(head) if cfg.is_dspark else {}
    config = {
        "speculators_model_type": "dspark" if cfg.is_dspark else "dflash",
        "architectures": [DSPARK_SPECULATOR if cfg.is_dspark else DFLASH_SPECULATOR],
        "transformer_layer_config": {**qwen3_layers_config(head, options), **dspark},
        **dspark,
        "draft_vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),  # HF indices; vLLM passes i - 1 to the model
        "mask_token_id": cfg.mask_token_id,
        # vLLM's update_dflash sets dflash_config.causal = not sliding_window_non_causal (default true) and
        # qwen3_dflash.py applies that to every draft layer, full-attention ones included: false would run a
        # block drafter causally. The library itself keeps full-attention layers bidirectional either way.
        "sliding_window_non_causal": True,
        # DFlash: the anchor is the root (bonus) token, block_size - 1 drafts; DSpark: the anchor's slot drafts too
        "sample_from_anchor": cfg.is_dspark,
        "speculators_config": _proposals("dspark" if cfg.is_dspark else "dflash", cfg.drafts_per_block, facts),
        "torch_dtype": dtype,
        "dtype": dtype,
        PROVENANCE_KEY: provenance_record(head, "speculators", facts),
    }
    return Artifact(config, tensors)


def dflash_layout(config: dict[str, Any]) -> dict[str, Any]:
    """A speculators dflash config seen as z-lab's layout (what ``update_dflash`` in vLLM makes of it),
    for the shared DFlash checks and import."""
    layer = config.get("transformer_layer_config")
    layer = layer if isinstance(layer, dict) else {}
    ids = config.get("aux_hidden_state_layer_ids")
    target = ((config.get(PROVENANCE_KEY) or {}).get("target") or {}).get("num_layers")
    return {
        **layer,
        **({DSPARK_RANK: config.get(DSPARK_RANK)} if config.get("speculators_model_type") == "dspark" else {}),
        "architectures": [DFLASH_ARCHITECTURE],
        "block_size": config.get("block_size"),
        "num_target_layers": target,
        UNKNOWN_TARGET_LAYERS: target is None,  # foreign checkpoints record no target depth
        "dflash_config": {"mask_token_id": config.get("mask_token_id"),
                          "target_layer_ids": [i - 1 for i in ids] if isinstance(ids, list) and
                          all(isinstance(i, int) and not isinstance(i, bool) for i in ids) else ids},
        "torch_dtype": config.get("torch_dtype"),
        PROVENANCE_KEY: config.get(PROVENANCE_KEY),
    }


def _speculators_dflash_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    kind = config.get("speculators_model_type")
    dspark = kind == "dspark"
    if kind not in DFLASH_TYPES:
        problems.append(f"config speculators_model_type={kind!r}, expected one of {sorted(DFLASH_TYPES)}")
    expect(config, "architectures", [DFLASH_TYPES.get(kind, DFLASH_SPECULATOR)], problems)
    if not isinstance(config.get("transformer_layer_config"), dict):
        return problems + ["transformer_layer_config is missing (vLLM reads the draft layers' shape from it)"]
    if bool(config.get("sample_from_anchor", dspark)) != dspark:  # speculators' defaults: dspark true, dflash false
        problems.append(f"sample_from_anchor={str(config.get('sample_from_anchor')).lower()}: draftsmith's "
                        + ("DSpark drafts from the anchor's slot on" if dspark else "DFlash drafts from the mask "
                           "positions only"))
    if dspark:
        problems += _dspark_field_problems(config)
    block = config.get("block_size")
    tokens = ((config.get("speculators_config") or {}).get("proposal_methods") or [{}])[0].get("speculative_tokens")
    most = (block if dspark else block - 1) if isinstance(block, int) else None
    if isinstance(most, int) and isinstance(tokens, int) and tokens > most:
        problems.append(f"speculative_tokens={tokens} exceeds block_size{'' if dspark else ' - 1'} = {most}")
    if config.get("draft_vocab_size") != (config["transformer_layer_config"].get("vocab_size")):
        problems.append(f"draft_vocab_size={config.get('draft_vocab_size')!r} differs from the vocab_size "
                        "(a reduced DFlash vocabulary is not written by draftsmith)")
    return problems + _speculators_config_problems(config) + _dflash_problems(dflash_layout(config), tensors)


def _dspark_field_problems(config: dict[str, Any]) -> list[str]:
    """The DSpark keys as speculators, and (inside transformer_layer_config) vLLM's qwen3_dspark.py, read them."""
    problems: list[str] = []
    layer = config["transformer_layer_config"]
    for key, want in (("markov_head_type", "vanilla"), ("enable_confidence_head", True),
                      ("confidence_head_with_markov", True)):
        expect(config, key, want, problems)
        if layer.get(key, want) != want:
            problems.append(f"transformer_layer_config.{key}={layer.get(key)!r}, expected {want!r}")
    if layer.get("enable_confidence_head") is not True:
        problems.append("transformer_layer_config.enable_confidence_head must be true: vLLM's qwen3_dspark.py reads "
                        "it there and otherwise drops the confidence head")
    return problems


def speculators_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    """Problems of a speculators export (eagle3, peagle, dflash or dspark) as vLLM and the speculators library read it."""
    if config.get("speculators_model_type") in DFLASH_TYPES:
        problems = _speculators_dflash_problems(config, tensors)
        if "sliding_window_non_causal" not in config:  # vLLM: not config.get("sliding_window_non_causal", True)
            problems.append("sliding_window_non_causal is missing: vLLM's update_dflash reads that as true (non-causal "
                            "blocks, as trained), speculators 0.9.0's DFlashSpeculatorConfig as false (causal "
                            "sliding-window layers); write true so both read it alike")
        elif config["sliding_window_non_causal"] is not True:
            problems.append(f"sliding_window_non_causal={config['sliding_window_non_causal']!r}: vLLM's "
                            "update_dflash would make every draft layer causal (dflash_config.causal = not it); "
                            "write true")
        return problems
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return ["transformer_layer_config is missing (vLLM reads the layer shape from it)"]
    if config.get("speculators_model_type") == "peagle":  # P-EAGLE: its own keys, then the EAGLE-3 layout it extends
        return peagle_problems(config, tensors) + speculators_problems(*as_eagle3(config, tensors))
    own = {k: v for k, v in tensors.items() if k != EMBED_TOKENS}
    problems = _speculators_problems(config) + _eagle3_problems(layer, config, own, SPECULATORS_LAYER_PREFIX)
    expect_tensor(tensors, EMBED_TOKENS, (layer.get("vocab_size"), config.get("target_hidden_size")), problems,
                  "speculators' Eagle3DraftModel leaves it uninitialised unless the file holds the target's")
    return problems


def import_speculators_dflash(path_or_repo: str | Path, *, dtype: torch.dtype | None = None,
                              **hub_kwargs: Any) -> DFlashHead:
    """A ``DFlashHead`` from a speculators dflash or dspark checkpoint (our ``--to speculators`` exports, or the
    speculators library's: the copies of the verifier's ``embed_tokens``/``lm_head``/``t2d``/``d2t`` it
    saves are dropped — draftsmith's DFlash reads the target's own). Checked as an export is."""
    directory, config, tensors = read_checkpoint(path_or_repo, hub_kwargs)
    own = {k: v for k, v in tensors.items() if k not in VERIFIER_COPIES}
    problems = _speculators_dflash_problems(config, own)
    if problems:
        raise ValueError(f"{directory} is not a speculators dflash checkpoint draftsmith can load:\n  - "
                         + "\n  - ".join(problems))
    return head_from_layout(dflash_layout(config), own, directory, dtype, "speculators dflash checkpoint")


# What the speculators library also saves from its verifier (draftsmith's DFlash uses the target's own).
VERIFIER_COPIES = ("embed_tokens.weight", "lm_head.weight", "t2d", "d2t")
