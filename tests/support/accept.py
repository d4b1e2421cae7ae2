"""Helpers moved out of tests/infer/test_infer_accept.py (other test files share them; no tests here)."""
from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer ``counts`` (V,) to ``probs`` (V,); impossible outcomes -> 0."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    n = counts.sum().double()
    expected = probs[support].double() / probs[support].sum() * n
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF's temperature -> top-k -> top-p, written out independently for one row (V,)."""
    scores = logits.double() / temperature
    if top_k:
        kth = scores.sort(descending=True).values[min(top_k, scores.numel()) - 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th are kept
    if top_p < 1.0:
        order = scores.argsort()  # ascending
        cum = scores[order].softmax(-1).cumsum(-1)
        remove = cum <= 1 - top_p
        remove[-1] = False  # min_tokens_to_keep = 1
        scores[order[remove]] = float("-inf")
    return scores.softmax(-1)
