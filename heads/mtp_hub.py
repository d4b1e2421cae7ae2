"""``head.init=native`` for a target loaded by Hub id: only its index file and the shards that hold MTP tensors
are downloaded (``huggingface_hub.snapshot_download`` restricted to them), never the trunk's other shards."""
from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import snapshot_download

from draftsmith.data.targets import hub_errors
from draftsmith.heads.mtp_layout import is_mtp_name

INDEX = "model.safetensors.index.json"


def mtp_shards(weight_map: dict[str, str], style: str, layers: int, n: int) -> list[str]:
    """The shard files an index maps MTP tensors to."""
    return sorted({file for name, file in weight_map.items() if is_mtp_name(style, layers, n, name)})


def hub_mtp_folder(repo_id: str, style: str, layers: int, n: int, revision: str | None = None) -> Path:
    """A local snapshot of ``repo_id`` holding its index and the shards with its MTP tensors (a one-file
    checkpoint: that file); one-line error when its index maps no MTP tensor."""
    with hub_errors(repo_id):
        first = Path(snapshot_download(repo_id, allow_patterns=[INDEX], revision=revision))
        if not (first / INDEX).is_file():
            shards = ["model.safetensors"]
        else:
            shards = mtp_shards(json.loads((first / INDEX).read_text())["weight_map"], style, layers, n)
            if not shards:
                raise ValueError(f"head.init=native: {repo_id}'s {INDEX} maps no MTP tensor; the checkpoint was "
                                 "published without its MTP layers")
        return Path(snapshot_download(repo_id, allow_patterns=[INDEX, *shards], revision=revision))
