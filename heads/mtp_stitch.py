"""``draftsmith stitch``: a copy of a target's checkpoint folder with an MTP head's tensors in it, in the family's
own names (``heads.formats.mtp``): the user's folder is read, never written; the copy's MTP tensors (any the
target had are replaced) go to a shard of their own, ``model-mtp.safetensors``, and its
``model.safetensors.index.json`` maps every tensor (a one-file checkpoint becomes ``model-trunk.safetensors`` plus
that shard). Written into a staging folder beside OUT_DIR, read back and checked, then moved into place."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig

from draftsmith.heads.common import text_config
from draftsmith.heads.formats import MTP_ARCHITECTURE, validate_export
from draftsmith.heads.formats.mtp import mtp_tensors
from draftsmith.heads.mtp_hub import INDEX
from draftsmith.heads.mtp_layout import is_mtp_name
from draftsmith.heads.mtp_native import target_mtp_layers

STITCH_MARKER = ".draftsmith-stitch"  # --overwrite replaces only a folder a stitch wrote
MTP_SHARD = "model-mtp.safetensors"
TRUNK_SHARD = "model-trunk.safetensors"  # a one-file checkpoint's tensors, once the folder has an index


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file of a checkpoint folder (its index, else its one ``model.safetensors``)."""
    if (folder / INDEX).is_file():
        return json.loads((folder / INDEX).read_text())["weight_map"]
    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"{folder}: no {INDEX} and no model.safetensors (a safetensors checkpoint is needed)")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _check_paths(target: Path, out: Path, overwrite: bool) -> None:
    if not (target / "config.json").is_file():
        raise ValueError(f"{target}: not a model folder (no config.json)")
    t, o = target.resolve(), out.resolve()
    if o == t or t in o.parents or o in t.parents:
        raise ValueError(f"refusing to stitch into {out}: it is, lies inside or contains the target folder {target}, "
                         "which is never written")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file; choose another OUT_DIR")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass --overwrite to replace an earlier stitch there")
        if not (out / STITCH_MARKER).is_file():
            raise ValueError(f"refusing to replace {out}: no {STITCH_MARKER} (not a folder draftsmith stitch wrote)")


def _source_tensors(source: str, target: Path, names: dict[str, str]) -> tuple[dict[str, Tensor], str, int, int]:
    """(tensors under the family's names, layout, MTP layers, trunk layers) of an export or an MTP head."""
    from draftsmith.heads import AutoHead

    config_path = Path(source) / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if MTP_ARCHITECTURE in (config.get("architectures") or []):
        validate_export(source, "mtp")
        return (load_file(str(Path(source) / "model.safetensors")), config["mtp_layout"], config["num_mtp_layers"],
                config["target_num_hidden_layers"])
    head = AutoHead.from_pretrained(source)
    if head.head_kind != "mtp":
        raise ValueError(f"{source}: a {head.head_kind} head; stitch takes an MTP head or an --to mtp export")
    tied = "lm_head.weight" not in names
    shared = {"embedding": _read(target, names, "model.embed_tokens.weight"),
              "lm_head": _read(target, names, "model.embed_tokens.weight" if tied else "lm_head.weight")}
    return (mtp_tensors(head, shared), head.config.style, head.config.num_mtp_layers or 1,
            head.config.target_num_layers)


def _read(folder: Path, names: dict[str, str], name: str) -> Tensor | None:
    if name not in names:
        return None
    with safe_open(str(folder / names[name]), framework="pt") as f:
        return f.get_tensor(name)


def _copy_trunk(target: Path, staging: Path, names: dict[str, str], is_mtp) -> dict[str, str]:
    """Every file of ``target`` into ``staging`` but its index, shards without their MTP tensors; the trunk's
    weight map."""
    shards = set(names.values())
    for path in sorted(p for p in target.rglob("*") if p.is_file()):
        rel = path.relative_to(target)
        if str(rel) not in shards and rel.name != INDEX:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, staging / rel)
    kept: dict[str, str] = {}
    for shard in sorted(shards):
        keep = [k for k, f in names.items() if f == shard and not is_mtp(k)]
        new = TRUNK_SHARD if shard == "model.safetensors" else shard
        if len(keep) == sum(f == shard for f in names.values()):
            shutil.copy2(target / shard, staging / new)
        elif keep:
            with safe_open(str(target / shard), framework="pt") as f:
                save_file({k: f.get_tensor(k) for k in keep}, str(staging / new), metadata={"format": "pt"})
        kept.update({k: new for k in keep})
    return kept


def stitch(source: str, target_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write a copy of ``target_dir`` with ``source``'s MTP tensors (an ``--to mtp`` export or an MTP head) to
    ``out_dir``; one-line errors naming the path for every refusal."""
    target, out = Path(target_dir), Path(out_dir)
    _check_paths(target, out, overwrite)
    config = text_config(AutoConfig.from_pretrained(target))
    style, declared = target_mtp_layers(config)
    names = weight_map(target)
    tensors, theirs, n, layers = _source_tensors(str(source), target, names)
    if (theirs, n, layers) != (style, declared, config.num_hidden_layers):
        raise ValueError(f"{source}: {n} MTP layer(s) in the {theirs} layout after {layers} trunk layers; {target} "
                         f"declares {declared} in the {style} layout after {config.num_hidden_layers}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / STITCH_MARKER).write_text(f"written by draftsmith stitch from {target}\n")
        kept = _copy_trunk(target, staging, names, lambda k: is_mtp_name(style, layers, n, k))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / MTP_SHARD), metadata={"format": "pt"})
        _write_index(staging, target, {**kept, **{k: MTP_SHARD for k in tensors}})
        back = load_file(str(staging / MTP_SHARD))
        if sorted(back) != sorted(tensors) or not all(torch.equal(back[k], v) for k, v in tensors.items()):
            raise ValueError(f"{staging / MTP_SHARD}: the MTP tensors changed on disk")
        if out.is_dir():
            shutil.rmtree(out)  # empty, or an earlier stitch (checked above)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _write_index(staging: Path, target: Path, names: dict[str, str]) -> None:
    old = json.loads((target / INDEX).read_text()).get("metadata", {}) if (target / INDEX).is_file() else {}
    total = 0
    for shard in sorted(set(names.values())):
        with safe_open(str(staging / shard), framework="pt") as f:
            total += sum(_nbytes(f, k) for k in f.keys())
    index = {"metadata": {**old, "total_size": total}, "weight_map": dict(sorted(names.items()))}
    (staging / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(f, name: str) -> int:
    tensor = f.get_tensor(name)
    return tensor.numel() * tensor.element_size()
