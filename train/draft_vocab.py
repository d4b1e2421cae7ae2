"""EAGLE-3 draft vocabulary: the N most frequent target tokens over loss-masked training positions.

The selection is sorted by target id (``d2t`` offsets need it) and cached as JSON under a key of
(training-data key, target vocab size, N), so a restarted or resumed run reuses it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger("draftsmith.train")


@dataclass
class DraftVocab:
    ids: Tensor  # (N,) int64 target ids, strictly increasing
    coverage: float  # share of loss-masked training tokens inside the vocab
    cache_path: str
    cache_hit: bool


def token_counts(examples: Iterable[dict], vocab_size: int, batch_size: int = 1024) -> Tensor:
    """(V,) int64 counts of the tokens at ``loss_mask == 1`` positions.

    ``examples`` is a ``datasets.Dataset`` (read in numpy batches) or any iterable of rows with
    ``input_ids`` and ``loss_mask``.
    """
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in _rows(examples, batch_size):
        tokens = ids[mask.astype(bool)]
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise ValueError(f"token id {int(tokens.max())} is outside the target vocabulary of {vocab_size}")
        counts += np.bincount(tokens, minlength=vocab_size)
    return torch.from_numpy(counts)


def _rows(examples: Iterable[dict], batch_size: int):
    iter_batches = getattr(examples, "iter", None)
    if callable(iter_batches):  # datasets.Dataset: arrow batches, no per-row Python objects
        for batch in examples.with_format("numpy").iter(batch_size=batch_size):
            for ids, mask in zip(batch["input_ids"], batch["loss_mask"]):
                yield np.asarray(ids, dtype=np.int64), np.asarray(mask)
        return
    for row in examples:
        yield np.asarray(row["input_ids"], dtype=np.int64), np.asarray(row["loss_mask"])


def select_draft_vocab(counts: Tensor, size: int) -> Tensor:
    """The ``size`` most frequent ids of ``counts`` (V,), ties broken by lower id, sorted by id."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"draft vocab size {size} must lie in [1, {counts.numel()}] (the target's vocab)")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: lower id first on ties
    return order[:size].sort().values


def coverage(ids: Tensor, tokens: Tensor) -> float:
    """Share of ``tokens`` (any shape, target ids) that lie in the draft vocab ``ids``."""
    if tokens.numel() == 0:
        return float("nan")
    return torch.isin(tokens, ids.to(tokens.device)).float().mean().item()


def _read_cached(path: Path, vocab_size: int, size: int) -> tuple[Tensor, float] | None:
    """The ids and coverage a cached selection holds, None when the file is cut, edited or not one."""
    try:
        record = json.loads(path.read_text())
        ids, covered = record["ids"], record["coverage"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not (isinstance(ids, list) and len(ids) == size and all(type(i) is int for i in ids)
            and isinstance(covered, float) and 0 <= covered <= 1):
        return None
    tensor = torch.tensor(ids, dtype=torch.long)
    if size and (int(tensor[0]) < 0 or int(tensor[-1]) >= vocab_size or not bool((tensor[1:] > tensor[:-1]).all())):
        return None
    return tensor, covered


def build_draft_vocab(
    examples: Iterable[dict], *, vocab_size: int, size: int, data_key: str, cache_dir: str | os.PathLike
) -> DraftVocab:
    """Select (or load from cache) the draft vocab of ``size`` tokens for training data ``data_key``.

    ``data_key`` must change whenever the tokenized examples do (``data.pipeline`` cache key).
    """
    key = hashlib.sha256(json.dumps([data_key, vocab_size, size]).encode()).hexdigest()[:24]
    path = Path(cache_dir) / f"{key}.json"
    if path.is_file():
        cached = _read_cached(path, vocab_size, size)
        if cached is not None:
            return DraftVocab(*cached, str(path), True)
        logger.warning("the cached draft vocabulary %s is damaged (not %d increasing ids below %d with their "
                       "coverage): choosing it again", path, size, vocab_size)
    counts = token_counts(examples, vocab_size)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("the training data has no loss-masked tokens; cannot choose a draft vocabulary")
    ids = select_draft_vocab(counts, size)
    covered = int(counts[ids].sum()) / total
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")  # atomic: ranks may race
    tmp.write_text(json.dumps({"data_key": data_key, "vocab_size": vocab_size, "size": size,
                               "coverage": covered, "ids": ids.tolist()}))
    os.replace(tmp, path)
    return DraftVocab(ids, covered, str(path), False)
