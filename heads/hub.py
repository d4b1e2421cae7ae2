"""Publishing a head, or one of its engine exports, on the Hugging Face Hub with its model card."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi

from draftsmith.heads.auto import AutoHead
from draftsmith.heads.card import TRAINING_FILES, model_card, training_info
from draftsmith.heads.common import DraftHead
from draftsmith.heads.formats import EXPORT_MARKER, FORMATS, export_head


def push_head_to_hub(
    head: DraftHead | str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    fmt: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a head (an object or a saved directory) with a generated model card; returns the commit URL.

    Uploads config.json, the weights, README.md and, from a head directory, the training loop's
    ``metrics.jsonl``/``config.yaml``. With ``fmt`` (see ``heads.formats.FORMATS``) the repo holds that
    engine export instead, so vLLM/SGLang can load it by repo id (EAGLE-3 exports still load with
    ``AutoHead``). Everything is staged and checked locally before the first network call.
    """
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown format '{fmt}'; expected one of {list(FORMATS)}")
    head_dir = None if isinstance(head, DraftHead) else Path(head)
    if head_dir is not None:
        head = AutoHead.from_pretrained(head_dir)  # a broken directory fails here, before any upload
    info = training_info(head_dir) if head_dir is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "upload"
        export_config = None
        if fmt is None:
            head.save_pretrained(stage)
            _check_reload(head, stage)
        else:
            export_head(head, stage, fmt)
            (stage / EXPORT_MARKER).unlink()  # marks a local folder as ours to replace; not for the Hub
            export_config = json.loads((stage / "config.json").read_text())
        for name in TRAINING_FILES:
            if head_dir is not None and (head_dir / name).is_file():
                shutil.copyfile(head_dir / name, stage / name)
        card = model_card(head, repo_id=repo_id, fmt=fmt, export_config=export_config, training=info)
        (stage / "README.md").write_text(card)
        api = HfApi(token=token)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=stage,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or f"Upload {head.head_kind} draft head" + (f" ({fmt})" if fmt else ""),
        )
    return commit.commit_url


def _check_reload(head: DraftHead, directory: Path) -> None:
    """The staged files load back into an identical head."""
    loaded = AutoHead.from_pretrained(directory)
    mine, theirs = head.state_dict(), loaded.state_dict()
    differ = sorted(k for k in mine.keys() | theirs.keys()
                    if k not in mine or k not in theirs or not torch.equal(mine[k].cpu(), theirs[k].cpu()))
    if differ:
        raise ValueError(f"{directory}: the saved head does not load back identically (tensors {differ})")
