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

from draftsmith.heads.dflash import DFlashConfig, DFlashHead

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


class DSparkConfig(DFlashConfig):
    """DSpark's config: DFlash's fields, ``variant="dspark"``, and ``markov_rank`` (None: 256)."""

    variant = "dspark"
    is_dspark = True
    first_draft_slot = 0  # slot k drafts the token k+1 after the root (the root's slot drafts too)

    def __init__(self, **kwargs):  # its own: transformers makes a config class without one a dataclass
        super().__init__(**kwargs)

    def _set_variant_options(self, given: dict) -> None:
        self.markov_rank = int(DEFAULT_MARKOV_RANK if given["markov_rank"] is None else given["markov_rank"])
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank} must be at least 1 (DSpark's Markov head)")


class DSparkHead(DFlashHead):
    """The DFlash head with DSpark's Markov and confidence heads."""

    config_class = DSparkConfig
    title = "DSpark"

    def _variant_input_lines(self) -> list[str]:
        cfg = self.config
        return [f"- DSpark: every slot drafts the token after it (the root's slot too: {cfg.block_size} drafts); "
                f"a rank-{cfg.markov_rank} Markov bias from the previous token and a confidence head that sets "
                "how many drafts each row verifies"]

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        return ["vLLM (speculators flavour, `speculators_model_type: dspark`):", "", *export_step("speculators"),
                "```bash", f"vllm serve {serve_dir}", "```", "",
                "SGLang (DeepSpec's `Qwen3DSparkModel` layout):", "", *export_step("dspark"), "```bash",
                f"python -m sglang.launch_server --model-path {served} --speculative-algorithm DSPARK "
                f"--speculative-draft-model-path {serve_dir}", "```", ""]

    def _add_variant_modules(self, config: DFlashConfig) -> None:
        self.markov_head = MarkovHead(config.vocab_size, config.markov_rank)
        self.confidence_head = ConfidenceHead(config.hidden_size + config.markov_rank)
