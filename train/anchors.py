"""Where training draft chains start: random anchors drawn per document inside runs of training targets
(DFlash's blocks, and the roots of the on-policy stage's chains for every kind). docs/dflash.md says why."""
from __future__ import annotations

import torch
from torch import Tensor


def segments(loss_mask: Tensor, document_ids: Tensor | None = None) -> Tensor:
    """(B, T) long: runs of training targets, numbered along the row; a new run starts at every token with
    loss_mask 0 and at every document start. Labels a..a+k lie in one run iff their numbers are equal."""
    brk = ~loss_mask.bool()
    if document_ids is not None:
        brk = brk.clone()
        brk[:, 1:] |= document_ids[:, 1:] != document_ids[:, :-1]
    return brk.long().cumsum(1)


def draw_anchors(loss_mask: Tensor, count: int, generator: torch.Generator | None = None, *, spacing: int = 1,
                 document_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(anchors, keep), both (B, N): per document of each row up to ``count`` random anchors a, at least
    ``spacing`` apart, with 1 <= a <= T-2 and a, a+1 in one run of training targets (``segments``); sorted,
    rows with fewer filled with 1 and ``keep = False``. ``document_ids`` (B, T): the documents of packed rows
    (None: a row is one document)."""
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    seg = segments(loss_mask, document_ids)
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if seq_len >= 3:
        valid[:, 1: seq_len - 1] = loss_mask[:, 1: seq_len - 1].bool() & (seg[:, 1: seq_len - 1] == seg[:, 2:])
    docs = document_ids if document_ids is not None else torch.zeros_like(loss_mask, dtype=torch.long)
    order = torch.rand(loss_mask.shape, generator=generator, device=device).argsort(dim=1)  # a random order per row
    picked: list[list[int]] = []
    for b in range(batch):  # note: host-device syncs, once per row; rows are few and T small next to the forward
        chosen: dict[int, list[int]] = {}
        row_docs, row_valid = docs[b].tolist(), valid[b].tolist()
        for a in order[b].tolist():
            if not row_valid[a]:
                continue
            mine = chosen.setdefault(row_docs[a], [])
            if len(mine) < count and all(abs(a - other) >= spacing for other in mine):
                mine.append(a)
        picked.append(sorted(a for mine in chosen.values() for a in mine))
    n = max(1, max(len(p) for p in picked))
    anchors = torch.ones(batch, n, dtype=torch.long, device=device)
    keep = torch.zeros(batch, n, dtype=torch.bool, device=device)
    for b, row in enumerate(picked):
        anchors[b, : len(row)] = torch.tensor(row, dtype=torch.long, device=device)
        keep[b, : len(row)] = True
    return anchors, keep
