"""``train.init_from``: start a run's head from a head trained earlier instead of from scratch: a draftsmith
head directory (e.g. trained on the base model of a target that is now a PEFT adapter on it), or any checkpoint
draftsmith's importers read (``AutoHead.from_pretrained``): public and SpecForge EAGLE-3 (vLLM / SGLang
layout), speculators ``eagle3`` / ``dflash`` / ``dspark``, z-lab's DFlash and DFlash2, DeepSpec's DSpark, and
our own exports of those formats. EAGLE-1 and Medusa exports have no importer (their formats drop what the
head needs to be rebuilt: refused by ``AutoHead`` in one line)."""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from draftsmith.data.base.names import is_head_model_type
from draftsmith.data.targets import check_head_source

# Config keys a warm start may change: which target the head is for, and what saving records.
_FREE_KEYS = {"target_name_or_path", "target_base_name_or_path", "target_architecture", "target_model_type",
              "target_max_position_embeddings", "_name_or_path", "transformers_version", "architectures", "dtype",
              "torch_dtype", "draft_temperature"}  # the last: fitted at each evaluation, carried below
# An imported checkpoint records no training-time settings of ours; these never change its weights' meaning
_IMPORT_FREE = {"max_position_embeddings", "initializer_range", "init",  # init: MTP's native/fresh start, replaced
                "draft_temperature"}


def _native(source: str) -> bool:
    """Whether ``source`` is a draftsmith head directory (not a checkpoint read through an importer)."""
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():  # a Hub id: AutoHead tells them apart; compare as an import (the keys it can check)
        return False
    return is_head_model_type(json.loads(config.read_text()).get("model_type"))


def fit_problems(head: nn.Module, trained: nn.Module) -> list[str]:
    """How a head read from a checkpoint does not fit this run's target: its vocabulary, its hidden size, the
    target width it reads and the target layers it reads (each as ``name: checkpoint vs target``)."""
    ours, theirs = head.config, trained.config
    found = [f"{name}: {getattr(theirs, name, None)} vs {getattr(ours, name, None)}"
             for name in ("vocab_size", "hidden_size") if getattr(theirs, name, None) != getattr(ours, name, None)]
    width = ours.target_hidden_size or ours.hidden_size
    if (theirs.target_hidden_size or theirs.hidden_size) != width:
        found.append(f"target hidden size: {theirs.target_hidden_size or theirs.hidden_size} vs {width}")
    layers, ids = ours.target_num_layers, list(getattr(theirs, "aux_layer_ids", None) or [])
    if layers and any(i >= layers for i in ids):
        found.append(f"layer ids: {ids} read past the target's {layers} layers")
    return found


def warm_start(head: nn.Module, source: str) -> None:
    """Copy the weights of the head at ``source`` into ``head`` (a fresh head of this run).

    Both must be the same kind with the same shape: a draftsmith head directory in every config key but the
    target's name and the saving records (target hidden size, layers and vocabulary included); an imported
    checkpoint first against the target (vocabulary, hidden size, target width, layer ids: one line naming
    each misfit), then in every option the head config takes. Otherwise ``ValueError`` names the keys and both
    values."""
    from draftsmith.heads import AutoHead
    from draftsmith.heads.auto import config_options

    check_head_source(source)
    trained = AutoHead.from_pretrained(source)
    if trained.head_kind != head.head_kind:
        raise ValueError(f"train.init_from={source}: a {trained.head_kind} head; this run trains "
                         f"head.kind={head.head_kind}")
    ours, theirs = head.config.to_dict(), trained.config.to_dict()
    if _native(source):
        keys = (set(ours) | set(theirs)) - _FREE_KEYS
    else:
        misfit = fit_problems(head, trained)
        if misfit:
            raise ValueError(f"train.init_from={source} does not fit this run's target (checkpoint vs target): "
                             + "; ".join(misfit))
        keys = set(config_options(type(head.config))) - _IMPORT_FREE
    diff = [f"{k}: {theirs.get(k)!r} (init_from) vs {ours.get(k)!r} (this run)"
            for k in sorted(keys) if ours.get(k) != theirs.get(k)]
    if diff:
        raise ValueError(f"train.init_from={source}: the head does not fit this run's: " + "; ".join(diff))
    head.load_state_dict(trained.state_dict(), strict=True)
    if getattr(trained.config, "draft_temperature", None) is not None:  # until this run's first evaluation fits its own
        head.config.draft_temperature = trained.config.draft_temperature
