"""DSpark's two heads on the DFlash backbone (``head.variant=dspark``; docs/dflash.md, "DSpark").

DSpark (DeepSeek + PKU; DeepSpec's ``deepspec/modeling/dspark``) reads every block slot k, the root
included, as the draft of the token k+1 after the root (DFlash reads slots 1.. as the token k after it),
and adds:

- ``MarkovHead``: a low-rank bias from the previous token on each slot's logits,
  ``logits_k + markov_w2(markov_w1[prev_k])`` (``markov_w1`` (V, r) an embedding, ``markov_w2`` (V, r) a
  linear without bias; DeepSpec's ``VanillaMarkov``, the only kind vLLM and SGLang serve). ``prev_k`` is
  the root for slot 0, then the token drafted (at inference) or the data's token (in training) at k-1.
- ``ConfidenceHead``: ``proj`` (Linear(H + r, 1) with bias) of ``[h_k ; markov_w1[prev_k]]``, a logit of
  the probability that slot k's draft is accepted (DeepSpec's ``AcceptRatePredictor`` with
  ``confidence_head_with_markov``). The drafter verifies a row's drafts up to the first slot whose
  confidence falls below a threshold (adaptive verification).

The tensor names are the ones DeepSpec, speculators, vLLM and SGLang all read: ``markov_head.markov_w1.weight``,
``markov_head.markov_w2.weight``, ``confidence_head.proj.weight``, ``confidence_head.proj.bias``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's checkpoints; SGLang's and vLLM's DSpark readers take it
DEFAULT_MARKOV_RANK = 256  # DeepSpec's Qwen3-4B config, speculators' default
# Adaptive verification's default threshold on sigmoid(confidence): a row verifies its drafts up to the first
# slot predicted below it (DeepSpec's _confident_prefix_length). 0 = verify every drafted slot.
DEFAULT_CONFIDENCE_THRESHOLD = 0.5


class MarkovHead(nn.Module):
    """``bias(prev) = markov_w2(markov_w1[prev])``: (..., V) logits added to a slot's, from its previous token."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev: Tensor) -> Tensor:
        return self.markov_w1(prev.long())

    def bias(self, embedded: Tensor) -> Tensor:
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """``proj([h ; markov_w1[prev]])``: the logit of a slot's acceptance."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        features = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()


@dataclass
class SlotOutputs:
    """What the Markov and confidence heads make of slots' logits given their previous tokens."""

    logits: Tensor  # (..., V) float32, the Markov-corrected logits
    confidence: Tensor  # (...) float32 logits of acceptance


def corrected(markov: MarkovHead, confidence: ConfidenceHead, hidden: Tensor, logits: Tensor,
              prev: Tensor) -> SlotOutputs:
    """Slots' Markov-corrected logits and confidence logits: hidden (..., H) the head's normed outputs,
    logits (..., V) their lm_head logits, prev (...) each slot's previous token."""
    embedded = markov.embed(prev)
    return SlotOutputs(logits.float() + markov.bias(embedded).float(), confidence(hidden, embedded))


def confident_lengths(confidence: Tensor, threshold: float) -> Tensor:
    """(R,) per row: the number of leading slots whose sigmoid(confidence) (R, n) is at least ``threshold``
    (all n when ``threshold`` <= 0)."""
    if threshold <= 0:
        return torch.full(confidence.shape[:1], confidence.shape[1], dtype=torch.long, device=confidence.device)
    below = confidence.sigmoid() < threshold
    return torch.where(below.any(-1), below.float().argmax(-1), torch.full_like(below[:, 0], confidence.shape[1],
                                                                                dtype=torch.long))
