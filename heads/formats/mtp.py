"""``--to mtp``: an MTP head's tensors in its target family's own checkpoint layout and names (DeepSeek-V3:
``model.layers.{L+i}.*``, Qwen3-Next: ``mtp.*``), per-expert MoE weights as releases hold them, plus the target
tensors the family's published checkpoints carry in their MTP layers (``heads.mtp_layout``: DeepSeek-V3's
``embed_tokens`` and ``shared_head.head``; none for Qwen3-Next). ``draftsmith stitch`` puts them into a copy of
the target's folder; ``import_mtp`` reads an export (or a folder whose checkpoint holds MTP layers) back as a head."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from draftsmith.heads.common import DraftHead, text_config
from draftsmith.heads.formats.validation import (PROVENANCE_KEY, Artifact, dtype_name, float_tensors,
                                                provenance_record)
from draftsmith.heads.mtp import MtpConfig, MtpHead
from draftsmith.heads.mtp_layout import MTP_LAYOUTS, carried_names, is_mtp_name
from draftsmith.heads.mtp_native import (checkpoint_name, fill_native, head_name, native_state_dict, read_native,
                                         target_mtp_layers)

MTP_ARCHITECTURE = "DraftsmithMtpLayers"  # config.json of an MTP export (no engine loads it alone: stitch it)
_OWN = ("enorm", "hnorm", "eh_proj", "post_norm")


def trunk_layers(head: DraftHead) -> int:
    return head.config.target_num_layers or head.config.family_config["num_hidden_layers"]


def mtp_tensors(head: DraftHead, shared: dict[str, Tensor | None], dtype=None) -> dict[str, Tensor]:
    """The head's tensors under the family's names, with the target tensors the layout carries (``shared``:
    ``embedding`` and ``lm_head``, (V, H) each); one-line error when one is needed and not given."""
    style, layers, n = head.config.style, trunk_layers(head), head.config.num_mtp_layers or 1
    tensors = native_state_dict(head)
    for name, which in carried_names(style, layers, n).items():
        if shared.get(which) is None:
            raise ValueError(f"the {style} layout's MTP layers carry the target's {which} ({name}, as its published "
                             "checkpoints do): pass the target (--target) so it can be copied")
        tensors[name] = shared[which].detach().clone()  # one copy per layer: safetensors refuses shared memory
    return float_tensors(tensors, dtype)


def _mtp_artifact(head: DraftHead, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    tensors = mtp_tensors(head, {"embedding": options["embedding"], "lm_head": options["lm_head"]}, options["dtype"])
    config = {
        "architectures": [MTP_ARCHITECTURE],
        "mtp_layout": head.config.style,
        "num_mtp_layers": head.config.num_mtp_layers or 1,
        "target_num_hidden_layers": trunk_layers(head),
        "hidden_size": head.config.hidden_size,
        "vocab_size": head.config.vocab_size,
        "family_config": head.config.family_config,
        "torch_dtype": dtype_name(tensors),
        PROVENANCE_KEY: provenance_record(head, "mtp", facts),
    }
    return Artifact(config, tensors)


def _mtp_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    problems = []
    if config.get("architectures") != [MTP_ARCHITECTURE]:
        problems.append(f"config architectures={config.get('architectures')!r}, expected {[MTP_ARCHITECTURE]!r}")
    style, layers, n = config.get("mtp_layout"), config.get("target_num_hidden_layers"), config.get("num_mtp_layers")
    if style not in MTP_LAYOUTS or not isinstance(layers, int) or not isinstance(n, int):
        return problems + [f"config mtp_layout={style!r} (one of {sorted(MTP_LAYOUTS)}), target_num_hidden_layers="
                           f"{layers!r}, num_mtp_layers={n!r}: no layout to check the names against"]
    h, v = config.get("hidden_size"), config.get("vocab_size")
    shapes = {"eh_proj": (h, 2 * h)}
    want = {checkpoint_name(style, layers, f"layers.{i}.{own}.weight"): shapes.get(own, (h,))
            for i in range(n) for own in _OWN}
    want |= {name: (v, h) for name in carried_names(style, layers, n)}
    for name, shape in want.items():
        if name not in tensors:
            problems.append(f"missing tensor {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name}: shape {tuple(tensors[name].shape)}, the config implies {shape}")
    stray = sorted(k for k in tensors if not is_mtp_name(style, layers, n, k))
    if stray:
        problems.append(f"tensors {stray[:6]} are not under the {style} layout's MTP names (a stitch would misplace them)")
    return problems


def import_mtp(path: str | Path) -> DraftHead:
    """An MTP head from an ``--to mtp`` export, or from a folder whose checkpoint holds MTP layers (a stitched
    target): its tensors, bit for bit."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{path}: an MTP export or a target folder with MTP layers is read from a local folder "
                         "with a config.json")
    config = json.loads((folder / "config.json").read_text())
    if MTP_ARCHITECTURE not in (config.get("architectures") or []):
        target = text_config(AutoConfig.from_pretrained(folder))
        head = _mtp_head(target)
        style, layers = head.config.style, target.num_hidden_layers
        fill_native(head, read_native(folder, style, layers, head.config.num_mtp_layers), f"{folder}'s MTP tensors")
        return head
    family = config["family_config"]
    target = CONFIG_MAPPING[family["model_type"]].from_dict(family)
    target._name_or_path = config.get(PROVENANCE_KEY, {}).get("target", {}).get("name_or_path", "")
    head = _mtp_head(target, num_mtp_layers=config["num_mtp_layers"])
    style, layers = config["mtp_layout"], config["target_num_hidden_layers"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {ours: f.get_tensor(k) for k in f.keys()
                   if (ours := head_name(style, layers, config["num_mtp_layers"], k)) is not None}
    fill_native(head, tensors, f"{folder}'s tensors")
    return head


def _mtp_head(target, **options: Any) -> DraftHead:
    """An MTP head shaped for ``target`` (a config), to be filled with checkpoint tensors."""
    return MtpHead(MtpConfig(**{**MtpHead.config_from_target(target), "init": "native", **options}))


def is_mtp_source(config: dict[str, Any]) -> bool:
    """Whether a config.json is an MTP export's or a target's that declares MTP layers (``import_mtp`` reads it)."""
    if MTP_ARCHITECTURE in (config.get("architectures") or []):
        return True
    return bool(target_mtp_layers(_Attrs(config.get("text_config") or config))[1])


class _Attrs:
    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)
