"""``head.init=native``: an MTP head's tensors read from the target checkpoint's own MTP layers (the tensors
transformers ignores at load: ``_keys_to_ignore_on_load_unexpected``), and the inverse naming (the family's
layout) for an export. Names as the engines' loaders read them (docs/mtp.md):

- DeepSeek-V3: ``model.layers.{L + i}.{enorm, hnorm, eh_proj}`` and ``.shared_head.norm`` (our ``post_norm``),
  the rest of ``model.layers.{L + i}.*`` the decoder block (``mtp_block``); ``.embed_tokens`` and
  ``.shared_head.head`` are the target's own embedding and lm_head, shared, not read.
- Qwen3-Next / Qwen3.5: ``mtp.pre_fc_norm_embedding`` (enorm), ``mtp.pre_fc_norm_hidden`` (hnorm), ``mtp.fc``
  (eh_proj), ``mtp.norm`` (post_norm), ``mtp.layers.{i}.*`` the decoder block.

The decoder block's tensors are in the family's checkpoint form (per-expert MoE weights); transformers' own
conversion mapping of the family turns them into its modules' form, as ``MtpModel.from_pretrained`` does.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

from draftsmith.data.base.names import looks_like_path
from draftsmith.heads.common import text_config
from draftsmith.heads.mtp_layout import is_mtp_name

_DEEPSEEK_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "post_norm"}
_DEEPSEEK_SHARED = ("embed_tokens.", "shared_head.head.")
_QWEN_OWN = {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "eh_proj", "norm": "post_norm"}


def target_mtp_layers(config: PretrainedConfig) -> tuple[str, int]:
    """(style, MTP layers) a target's text config declares: Qwen3-Next/Qwen3.5's ``mtp_num_hidden_layers``,
    DeepSeek-V3's ``num_nextn_predict_layers`` (transformers' ``num_mtp_layers``); (deepseek, 0) for none."""
    qwen = getattr(config, "mtp_num_hidden_layers", None)
    if qwen:
        return "qwen3_next", int(qwen)
    deepseek = getattr(config, "num_nextn_predict_layers", None) or getattr(config, "num_mtp_layers", None)
    return "deepseek", int(deepseek or 0)


def head_name(style: str, num_layers: int, mtp_layers: int, name: str) -> str | None:
    """The MTP head's parameter name (``layers.{i}.*``) of checkpoint tensor ``name``, or None when it is not
    one of the MTP layers' own tensors (the trunk's, or the shared embedding and lm_head)."""
    if style == "deepseek":
        found = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if not found or not num_layers <= int(found.group(1)) < num_layers + mtp_layers:
            return None
        i, rest = int(found.group(1)) - num_layers, found.group(2)
        if rest.startswith(_DEEPSEEK_SHARED):
            return None
        own = next((k for k in _DEEPSEEK_OWN if rest.startswith(k + ".")), None)
        return f"layers.{i}.{_DEEPSEEK_OWN[own]}{rest[len(own):]}" if own else f"layers.{i}.mtp_block.{rest}"
    found = re.match(r"mtp\.(.+)$", name)
    if not found:
        return None
    rest = found.group(1)
    own = next((k for k in _QWEN_OWN if rest.startswith(k + ".")), None)
    if own:
        return f"layers.0.{_QWEN_OWN[own]}{rest[len(own):]}"
    block = re.match(r"layers\.(\d+)\.(.+)$", rest)
    return f"layers.{block.group(1)}.mtp_block.{block.group(2)}" if block and int(block.group(1)) < mtp_layers else None


def checkpoint_name(style: str, num_layers: int, name: str) -> str:
    """The family's checkpoint name of MTP head parameter ``name`` (the inverse of ``head_name``)."""
    found = re.match(r"layers\.(\d+)\.(.+)$", name)
    i, rest = int(found.group(1)), found.group(2)
    if rest.startswith("mtp_block."):
        rest = rest[len("mtp_block."):]
        return f"model.layers.{num_layers + i}.{rest}" if style == "deepseek" else f"mtp.layers.{i}.{rest}"
    own, tail = rest.split(".", 1)
    table = _DEEPSEEK_OWN if style == "deepseek" else _QWEN_OWN
    family = next(k for k, v in table.items() if v == own)
    return f"model.layers.{num_layers + i}.{family}.{tail}" if style == "deepseek" else f"mtp.{family}.{tail}"


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a local checkpoint folder (those its index names, else every one)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def mtp_files(folder: Path, style: str, num_layers: int, mtp_layers: int) -> list[Path]:
    """The safetensors files of ``folder`` that hold MTP tensors: those its index maps them to, else every one
    (a download of the MTP shards alone has the others absent)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return checkpoint_files(folder)
    weight_map = json.loads(index.read_text())["weight_map"]
    return [folder / f for f in sorted({f for k, f in weight_map.items() if is_mtp_name(style, num_layers, mtp_layers, k)})]


def read_native(folder: Path, style: str, num_layers: int, mtp_layers: int) -> dict[str, Tensor]:
    """The MTP layers' tensors of the checkpoint in ``folder``, under the head's names (block tensors still in
    the family's checkpoint form)."""
    found: dict[str, Tensor] = {}
    for path in mtp_files(folder, style, num_layers, mtp_layers):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                ours = head_name(style, num_layers, mtp_layers, name)
                if ours is not None:
                    found[ours] = f.get_tensor(name)
    return found


def load_native(head: nn.Module, target: nn.Module) -> None:
    """Fill ``head`` (an ``MtpHead``) with ``target``'s checkpoint MTP tensors; one-line errors for a target that
    declares no MTP layer, a checkpoint that is no local folder, or one whose MTP tensors are missing."""
    config = text_config(target)
    style, declared = target_mtp_layers(config)
    where = getattr(config, "_name_or_path", "") or type(target).__name__
    if not declared:
        raise ValueError(f"head.init=native: target {where} declares no MTP layer (no num_nextn_predict_layers or "
                         "mtp_num_hidden_layers in its config); use head.init=fresh to train one from scratch")
    folder = native_folder(where, style, config.num_hidden_layers, head.config.num_mtp_layers or 1)
    tensors = read_native(folder, style, config.num_hidden_layers, head.config.num_mtp_layers or 1)
    prefix = f"model.layers.{config.num_hidden_layers}." if style == "deepseek" else "mtp."
    if not tensors:
        raise ValueError(f"head.init=native: {folder} holds no MTP tensors ({prefix}*), although its config declares "
                         f"{declared} MTP layer(s); the checkpoint was saved without them (transformers drops them at load)")
    fill_native(head, tensors, f"{folder}'s MTP tensors ({prefix}*)")


def native_folder(where: str, style: str, num_layers: int, mtp_layers: int) -> Path:
    """The local folder holding the target's checkpoint: ``where`` itself, or for a Hub id a download of its
    index and MTP shards only (``heads.mtp_hub``)."""
    folder = Path(where)
    if folder.is_dir():
        return folder
    if looks_like_path(where) or where.count("/") != 1:
        raise ValueError(f"head.init=native reads the MTP tensors from the target's checkpoint; {where} is neither a "
                         "local folder nor a Hub id")
    from draftsmith.heads.mtp_hub import hub_mtp_folder

    return hub_mtp_folder(where, style, num_layers, mtp_layers)


def fill_native(head: nn.Module, tensors: dict[str, Tensor], what: str) -> None:
    """Load ``tensors`` (head names, the family's checkpoint form) into ``head`` through transformers' conversion
    mapping of the family; one-line error naming ``what`` when they do not fill it exactly."""
    mapping = get_checkpoint_conversion_mapping(head.config.family_config["model_type"]) or []
    load = LoadStateDictConfig(weight_mapping=mapping, dtype=next(head.parameters()).dtype)
    info, _ = convert_and_load_state_dict_in_model(head, tensors, load)
    head.__dict__.pop("_weight_conversions", None)  # left by the loader: the head saves in its modules' own form
    missing = sorted(info.missing_keys)
    unexpected = sorted(info.unexpected_keys)
    if missing or unexpected:
        raise ValueError(f"head.init=native: {what} do not fill the head: missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]}")


@torch.no_grad()
def native_state_dict(head: nn.Module) -> dict[str, Tensor]:
    """The head's tensors under the family's checkpoint names and form (per-expert MoE weights), as a release
    carries them: the inverse of ``load_native``."""
    from transformers.core_model_loading import revert_weight_conversion

    head._weight_conversions = get_checkpoint_conversion_mapping(head.config.family_config["model_type"]) or None
    try:
        reverted = revert_weight_conversion(head, {k: v.detach().clone() for k, v in head.state_dict().items()})
    finally:
        del head._weight_conversions
    layers = head.config.target_num_layers or head.config.family_config["num_hidden_layers"]
    return {checkpoint_name(head.config.style, layers, k): v for k, v in reverted.items()}
