"""The training examples of a run: tokenized data checked against the target, and batching."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

from data.base.paths import cache_root
from train.config import TrainConfig


class IndexedRows(Dataset):
    """``examples`` with each row's index under ``"row"`` (stored features are found by it)."""

    def __init__(self, examples) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return {**self.examples[index], "row": index}


def collate(rows: list[dict], pad_id: int) -> dict[str, Tensor]:
    """Right-pad a list of examples to (B, T_max); padding has loss_mask 0. Rows of ``IndexedRows``
    also give ``rows`` (B,), their indices."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    length = int(lengths.max())
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        mask[i, : len(r["loss_mask"])] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
    batch = {"input_ids": ids, "loss_mask": mask, "lengths": lengths}
    if "row" in rows[0]:
        batch["rows"] = torch.tensor([r["row"] for r in rows])
    return batch


def load_examples(source: str, tokenizer, cfg: TrainConfig, vocab_size: int, key: str):
    """Tokenized examples of ``source`` (``data.pipeline``), checked against the target's vocab."""
    from data.pipeline import build_examples

    try:
        examples, summary = build_examples(source, tokenizer, max_length=cfg.data.max_length,
                                           overlong=cfg.data.overlong, strict=cfg.data.strict,
                                           lenient_json=cfg.data.lenient_json, cache_dir=run_cache_dir(cfg) / "data")
    except ValueError as err:  # no usable rows, or a bad row under data.strict: say which source
        raise ValueError(f"{key}={source!r}: {err}") from err
    import pyarrow.compute as pc  # on the arrow column: no Python list per example

    column = examples.data.column("input_ids")
    if pc.max(pc.list_value_length(column)).as_py() < 3:
        raise ValueError(f"{key}={source!r}: every example is shorter than 3 tokens; nothing to draft")
    top = pc.max(pc.list_flatten(column)).as_py()
    if top >= vocab_size:
        raise ValueError(f"{key}={source!r} holds token id {top} but the target's vocab has {vocab_size} "
                         "tokens: the tokenizer does not belong to this target")
    return examples, summary


def run_cache_dir(cfg: TrainConfig) -> Path:
    """The cache a training run uses: ``cache_dir`` if set, else draftsmith's cache root."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root()
