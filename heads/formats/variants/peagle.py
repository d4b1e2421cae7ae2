"""P-EAGLE heads in the speculators library's ``peagle`` layout (format ``speculators``, docs/export-keys.md,
"P-EAGLE"): read by speculators 0.9.0's ``PEagleDraftModel`` and vLLM's ``update_peagle`` (``PeagleLlamaForCausalLM``,
method eagle3 with ``parallel_drafting``: ``pard_token`` = ``mask_token_id``).

The layout is the speculators EAGLE-3 one (``heads.formats.speculators``: ``layers.0.*``, ``fc``, ``norm``,
``lm_head``, ``d2t``/``t2d``, the target's ``embed_tokens.weight``) with ``speculators_model_type: peagle``,
``architectures: ["PEagleSpeculator"]``, ``mask_token_id`` and two P-EAGLE facts:

- ``mask_hidden`` (1, 1, 3·target_hidden_size): the head's shared hidden state, as the library names and shapes it
  (vLLM copies it as (1, 3·H) and fuses it with ``fc``);
- the mask embedding: row ``mask_token_id`` of ``embed_tokens.weight`` (the library trains that table and vLLM
  embeds ``pard_token`` through the draft's own copy); every other row is the target's.

P-EAGLE's depth count K is recorded in the provenance block (``num_depths``) and is the proposal's
``speculative_tokens`` at most; a checkpoint that records none is read as K = its ``speculative_tokens``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from draftsmith.heads.formats.validation import PROVENANCE_KEY, Artifact, expect, expect_tensor
from draftsmith.heads.variants.peagle import PEAGLE_ARCHITECTURE

MASK_HIDDEN = "mask_hidden"
EMBED_TOKENS = "embed_tokens.weight"


def to_peagle(head, artifact: Artifact, options: dict[str, Any]) -> Artifact:
    """The speculators EAGLE-3 ``artifact`` of P-EAGLE ``head`` as the ``peagle`` layout."""
    cfg = head.config
    tokens = options["num_speculative_tokens"]
    if tokens > cfg.num_depths:
        raise ValueError(f"num_speculative_tokens={tokens} exceeds this P-EAGLE head's num_depths={cfg.num_depths} "
                         "(the depths it drafts); pass at most that many")
    tensors = dict(artifact.tensors)
    mask_embedding = tensors.pop("mask_embedding")
    embed = tensors[EMBED_TOKENS].clone()
    embed[cfg.mask_token_id] = mask_embedding.to(embed.dtype)
    tensors[EMBED_TOKENS] = embed
    config = dict(artifact.config)
    config.update(speculators_model_type="peagle", architectures=[PEAGLE_ARCHITECTURE], mask_token_id=cfg.mask_token_id)
    config["speculators_config"] = {**config["speculators_config"], "algorithm": "peagle"}
    config[PROVENANCE_KEY] = {**config[PROVENANCE_KEY], "num_depths": cfg.num_depths}
    return Artifact(config, tensors)


def peagle_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    """The P-EAGLE keys and tensors as speculators and vLLM read them (the EAGLE-3 rest: ``as_eagle3``)."""
    problems: list[str] = []
    expect(config, "architectures", [PEAGLE_ARCHITECTURE], problems)
    layer = config.get("transformer_layer_config") or {}
    vocab, width = layer.get("vocab_size"), config.get("target_hidden_size")
    mask = config.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not isinstance(vocab, int) or not 0 <= mask < vocab:
        problems.append(f"mask_token_id={mask!r} must be a token id in [0, vocab_size={vocab}) (vLLM's update_peagle "
                        "reads it as pard_token)")
    for key in ("fc_norm", "norm_output"):
        if config.get(key):
            problems.append(f"{key}=true: vLLM's update_peagle does not pass it on, its P-EAGLE would draft without it")
    expect_tensor(tensors, MASK_HIDDEN, (1, 1, 3 * width) if isinstance(width, int) else None, problems,
                  "P-EAGLE's shared hidden state; the library would start it at random")
    return problems


def as_eagle3(config: dict[str, Any], tensors: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A peagle config and tensors seen as the speculators EAGLE-3 layout they extend (for its shared checks)."""
    view = {**config, "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]}
    return view, {k: v for k, v in tensors.items() if k != MASK_HIDDEN}


def peagle_head_options(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The ``Eagle3Config`` keys of a speculators peagle checkpoint's config (none for eagle3)."""
    if config.get("speculators_model_type") != "peagle":
        return {}
    depths = (config.get(PROVENANCE_KEY) or {}).get("num_depths")
    if depths is None:
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        depths = methods[0].get("speculative_tokens")
    if config.get("mask_token_id") is None:
        raise ValueError(f"{directory}/config.json: a peagle checkpoint without mask_token_id")
    return {"variant": "peagle", "mask_token_id": config["mask_token_id"], "num_depths": depths}
