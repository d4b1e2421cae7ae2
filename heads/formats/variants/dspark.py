"""DSpark heads in DeepSpec's ``Qwen3DSparkModel`` layout (format ``dspark``), read by SGLang's DSPARK
(``python/sglang/srt/models/qwen3_dspark.py``) and vLLM's ``qwen3_dspark.py``; DeepSpec's checkpoints imported.

The layout (docs/export-keys.md, "DSpark"): a Qwen3 config with ``architectures: ["Qwen3DSparkModel"]``,
``num_hidden_layers`` (the draft's), ``num_target_layers``, ``block_size``, ``target_layer_ids`` (the *output*
of target layer k: draftsmith's HF indices - 1; SGLang reads this top-level key), ``mask_token_id``,
``markov_rank``, ``markov_head_type: vanilla``, ``enable_confidence_head``, ``confidence_head_with_markov``
and DeepSpec's training-only ``num_anchors``; ``dflash_config`` repeats ``target_layer_ids`` and
``mask_token_id`` for vLLM's DFlash backbone. Tensors: DFlash's (``fc``, ``hidden_norm``, ``layers.{i}.*``,
``norm``), ``markov_head.markov_w{1,2}.weight``, ``confidence_head.proj.{weight,bias}``, and the target's
``embed_tokens.weight`` / ``lm_head.weight`` (SGLang's loader refuses a checkpoint without them; draftsmith
writes the target's own, and drops them on import after checking they are the target's shape).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.heads.common import DraftHead
from draftsmith.heads.dflash import DFLASH_ARCHITECTURE, DFlashHead
from draftsmith.heads.variants.dspark import DSPARK_ARCHITECTURE
from draftsmith.heads.formats.dflash import (DSPARK_RANK, _dflash_problems, head_from_layout, qwen3_layers_config,
                                             read_checkpoint)
from draftsmith.heads.formats.parity import CHECKED_AGAINST
from draftsmith.heads.formats.validation import (Artifact, PROVENANCE_KEY, dtype_name, expect, float_tensors,
                                                 provenance_record)

VOCAB_COPIES = ("embed_tokens.weight", "lm_head.weight")  # the target's, which SGLang's loader requires
NUM_ANCHORS = 512  # DeepSpec's Qwen3DSparkModel asserts the key (training only); its Qwen3-4B config's value
# The README section of this format's exports (heads.formats.parity keeps the others; registered here, beside the
# layout, so that file stays the hardening work's)
CHECKED_AGAINST["dspark"] = [
    "DeepSpec's `Qwen3DSparkModel` layout and SGLang's `qwen3_dspark.py` loader (its mapping table: every tensor it "
    "requires is written), checked on export and on read-back; not run here, no engine runs on CPU"]


def dspark_fields(head: DraftHead) -> dict[str, Any]:
    """The DSpark keys DeepSpec, speculators, vLLM and SGLang read: the vanilla Markov head of the head's rank
    and the confidence head fed with the Markov embedding (the only forms vLLM and SGLang serve)."""
    return {DSPARK_RANK: head.config.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True}


def _dspark_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    cfg = head.config
    if not getattr(cfg, "is_dspark", False):
        raise ValueError(f"format 'dspark' carries DSpark heads (head.variant=dspark), got a {head.title} head")
    if not facts["num_layers"]:
        raise ValueError("the dspark format records num_target_layers; the head names no target layer count "
                         "(pass target= / --target)")
    copies = {"embed_tokens.weight": options.get("embedding"), "lm_head.weight": options.get("lm_head")}
    if any(t is None for t in copies.values()):
        raise ValueError("the dspark format carries the target's embed_tokens and lm_head (SGLang's Qwen3DSparkModel "
                         "refuses a checkpoint without them): pass target= the target model (--target)")
    tensors = float_tensors(head.state_dict(), options["dtype"])
    dtype = options["dtype"] or tensors["fc.weight"].dtype
    tensors.update(float_tensors({k: v.detach() for k, v in copies.items()}, dtype))
    ids = [i - 1 for i in cfg.aux_layer_ids]
    config = {
        "architectures": [DSPARK_ARCHITECTURE],
        **qwen3_layers_config(head, options),
        "block_size": cfg.block_size,
        "num_target_layers": facts["num_layers"],
        "target_layer_ids": ids,
        "mask_token_id": cfg.mask_token_id,
        "num_anchors": NUM_ANCHORS,
        **dspark_fields(head),
        "draft_vocab_size": cfg.vocab_size,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": cfg.mask_token_id},
        "torch_dtype": dtype_name(tensors),
        "dtype": dtype_name(tensors),
        PROVENANCE_KEY: provenance_record(head, "dspark", facts),
    }
    return Artifact(config, tensors)


def _as_dflash_layout(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSpec's config seen as z-lab's layout with a Markov rank (the shared DFlash checks and import)."""
    return {**config, "architectures": [DFLASH_ARCHITECTURE],
            "dflash_config": {"target_layer_ids": config.get("target_layer_ids"),
                              "mask_token_id": config.get("mask_token_id")}}


def _dspark_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems: list[str] = []
    expect(config, "architectures", [DSPARK_ARCHITECTURE], problems, "SGLang and DeepSpec key on it")
    expect(config, "markov_head_type", "vanilla", problems, "the only Markov head vLLM and SGLang serve")
    expect(config, "enable_confidence_head", True, problems)
    expect(config, "confidence_head_with_markov", True, problems, "SGLang serves no other")
    if config.get("num_anchors") is None:
        problems.append("num_anchors is missing (DeepSpec's Qwen3DSparkModel asserts it)")
    dflash = config.get("dflash_config") or {}
    if dflash.get("target_layer_ids") != config.get("target_layer_ids"):
        problems.append(f"dflash_config.target_layer_ids={dflash.get('target_layer_ids')!r} differs from "
                        f"target_layer_ids={config.get('target_layer_ids')!r}")
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    for name in VOCAB_COPIES:
        tensor = tensors.get(name)
        if tensor is None:
            problems.append(f"missing tensors ['{name}'] (SGLang's Qwen3DSparkModel refuses a checkpoint without it)")
        elif tuple(tensor.shape) != (vocab, hidden):
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected ({vocab}, {hidden})")
    own = {k: v for k, v in tensors.items() if k not in VOCAB_COPIES}
    return problems + _dflash_problems(_as_dflash_layout(config), own)


def import_dspark(path_or_repo: str | Path, *, dtype: torch.dtype | None = None, **hub_kwargs: Any) -> DFlashHead:
    """A DSpark ``DFlashHead`` from a ``Qwen3DSparkModel`` directory or Hub id (DeepSpec's checkpoints, our
    exports); its ``embed_tokens``/``lm_head`` copies are dropped (the head reads the target's own). Checked as
    an export is. ``hub_kwargs`` as ``import_eagle3``'s."""
    directory, config, tensors = read_checkpoint(path_or_repo, hub_kwargs)
    if -1 in (config.get("target_layer_ids") or []):
        raise ValueError(f"{directory}/config.json: target_layer_ids has -1 (DeepSpec's embedding output), which no "
                         "draftsmith DFlash head reads")
    problems = _dspark_problems(config, tensors)
    if problems:
        raise ValueError(f"{directory} is not a DSpark checkpoint draftsmith can load:\n  - " + "\n  - ".join(problems))
    own = {k: v for k, v in tensors.items() if k not in VOCAB_COPIES}
    return head_from_layout(_as_dflash_layout(config), own, directory, dtype, "DSpark checkpoint")
