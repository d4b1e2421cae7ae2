"""``build_head`` (a fresh head for a target) and ``AutoHead`` (load any saved head)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.heads.common import DraftHead
from draftsmith.heads.dflash import DFLASH2_ARCHITECTURE, DFLASH_ARCHITECTURE, DFlashConfig
from draftsmith.heads.eagle import EagleConfig
from draftsmith.heads.eagle3 import Eagle3Config
from draftsmith.heads.early_exit import EarlyExitConfig
from draftsmith.heads.kinds import (HEAD_CLASSES, VARIANT_CLASSES, config_options, head_class, kind_variants,
                                    variant_options)
from draftsmith.heads.medusa import MedusaConfig
from draftsmith.heads.variants.domino import DOMINO_ARCHITECTURE
from draftsmith.heads.variants.dspark import DSPARK_ARCHITECTURE

_BY_MODEL_TYPE = {cls.config_class.model_type: cls for cls in HEAD_CLASSES.values()}
# The public EAGLE-3 layout (EAGLE authors, SpecForge) is converted on load by heads.formats.
PUBLIC_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3Speculator", "PEagleSpeculator")


def build_head(kind: str, target: PretrainedConfig | PreTrainedModel, **options: Any) -> DraftHead:
    """An untrained head of ``kind`` (a key of ``HEAD_CLASSES``) shaped for ``target``.

    ``target`` is a config or a model; with a model, Medusa's lm_heads start as copies of the
    target's. ``options`` set head config fields (e.g. ``num_heads=5``, ``draft_vocab_size=2048``,
    ``aux_layer_ids=[1, 4, 7]``, ``intermediate_size=...``); unknown fields are errors.
    """
    head_cls = head_class(kind, options.get("variant"))
    allowed = set(config_options(head_cls.config_class))
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for a {kind} head; allowed: {sorted(allowed)}")
    try:
        head = head_cls(head_cls.config_class(**{**head_cls.config_from_target(target), **options}))
    except AttributeError as err:  # a Mamba, RWKV, ... config: no attention shape to mirror (or to build MTP layers of)
        config = getattr(target, "config", target)
        name = (getattr(config, "architectures", None) or [type(target).__name__])[0]
        raise ValueError(f"cannot build a {kind} head for {name} ({getattr(config, 'model_type', '?')}): {err} (draft "
                         "heads are built for decoder-only targets with attention layers; docs/hybrid.md lists the "
                         "hybrids)") from None
    if isinstance(target, PreTrainedModel):
        head.init_from_target_model(target)
    return head


class AutoHead:
    """Load a saved head (a local directory or a Hub repo id) into its own class."""

    @staticmethod
    def from_pretrained(path_or_repo: str | os.PathLike, **kwargs: Any) -> DraftHead:
        from draftsmith.data.targets import check_head_source, hub_errors

        if not kwargs.get("subfolder"):
            check_head_source(path_or_repo)
        with hub_errors(path_or_repo):
            config_dict, _ = PretrainedConfig.get_config_dict(str(path_or_repo), **_hub_kwargs(kwargs))
        model_type = config_dict.get("model_type")
        if model_type in _BY_MODEL_TYPE:
            cls = _BY_MODEL_TYPE[model_type]
            cls = head_class(cls.config_class.head_kind, config_dict.get("variant"))
            try:
                return cls.from_pretrained(path_or_repo, **kwargs)
            except SafetensorError as err:  # e.g. a truncated download: name the files
                files = sorted(p.name for p in Path(path_or_repo).glob("*.safetensors")) or ["*.safetensors"]
                raise ValueError(
                    f"{path_or_repo}: cannot read the head's weights {files} ({err}); the checkpoint is "
                    "incomplete or corrupt, save or download it again"
                ) from err
        from draftsmith.heads.formats.mtp import is_mtp_source

        if is_mtp_source(config_dict):  # an --to mtp export, or a (stitched) target folder holding MTP layers
            from draftsmith.heads.formats import import_mtp

            return import_mtp(path_or_repo)
        if any(a in PUBLIC_EAGLE3_ARCHITECTURES for a in config_dict.get("architectures") or []):
            from draftsmith.heads.formats import import_eagle3

            return import_eagle3(path_or_repo, **kwargs)
        if config_dict.get("speculators_model_type") in ("dflash", "dspark"):
            from draftsmith.heads.formats import import_speculators_dflash

            return import_speculators_dflash(path_or_repo, **kwargs)
        if DSPARK_ARCHITECTURE in (config_dict.get("architectures") or []):
            from draftsmith.heads.formats import import_dspark

            return import_dspark(path_or_repo, **kwargs)
        if {DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE, DOMINO_ARCHITECTURE} & set(config_dict.get("architectures") or []):
            from draftsmith.heads.formats import import_dflash

            return import_dflash(path_or_repo, **kwargs)
        raise ValueError(
            f"{path_or_repo}: config.json has model_type={model_type!r} and architectures="
            f"{config_dict.get('architectures')}, which is not a draftsmith head "
            f"({sorted(_BY_MODEL_TYPE)}) nor a public EAGLE-3 ({list(PUBLIC_EAGLE3_ARCHITECTURES)}) or DFlash "
            f"({DFLASH_ARCHITECTURE}, {DFLASH2_ARCHITECTURE}, {DOMINO_ARCHITECTURE}, speculators dflash) or DSpark ({DSPARK_ARCHITECTURE}, "
            "speculators dspark) checkpoint"
        )


def _hub_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    keys = ("revision", "token", "cache_dir", "local_files_only", "force_download", "subfolder")
    return {k: kwargs[k] for k in keys if k in kwargs}


__all__ = [
    "AutoHead",
    "build_head",
    "HEAD_CLASSES",
    "VARIANT_CLASSES",
    "head_class",
    "kind_variants",
    "config_options",
    "variant_options",
    "MedusaConfig",
    "EagleConfig",
    "Eagle3Config",
    "DFlashConfig",
    "EarlyExitConfig",
]
