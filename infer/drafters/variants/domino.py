"""Domino's drafter (``head.variant=domino``): DFlash's, walking the block with the GRU correction.

The GRU starts from a zero state on the root's embedding; slot k (from ``pure_draft_prefix_len`` on) adds
``embed_proj([h_k ; s_k])`` to its lm_head logits, s_k the state after the root and the tokens drafted at
slots 0..k-1; then the GRU steps on slot k's draft (SpecForge's ``_sample_draft_tokens``; SGLang's and vLLM's
rollouts start on the root and slot 0's draft, the same states). Greedy takes each corrected argmax;
sampling draws each slot from its corrected law q_k given the drafts before it (returned, for the generator's
min(1, p/q) chain check, which is lossless for any such q: the engines draft greedily only).
"""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.variants.domino import correction, gru_step
from draftsmith.infer.drafters.base import Sampling
from draftsmith.infer.drafters.dflash import DFlashDrafter, DFlashState


def domino_walk(head: nn.Module, embed: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, root: torch.Tensor,
                sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens (R, n), laws (R, n, V) or None when greedy) of a Domino walk.

    hidden (R, n, H): the head's normed outputs of slots 0..n-1; logits (R, n, V) float32 their lm_head
    logits; root (R,): the token before slot 0; ``embed`` the target's input embedding."""
    tokens, laws = [], []
    state = gru_step(head.prefix_gru, embed(root), None)
    for k in range(logits.shape[1]):
        slot = logits[:, k]
        if k >= head.config.pure_draft_prefix_len:
            slot = slot + correction(head.embed_proj, hidden[:, k], state)
        if sampling.greedy:
            token = slot.argmax(-1)
        else:
            law = sampling.probs(slot)  # (R, V)
            laws.append(law)
            token = torch.multinomial(law, 1)[:, 0]
        tokens.append(token)
        if k + 1 < logits.shape[1]:
            state = gru_step(head.prefix_gru, embed(token), state)
    return torch.stack(tokens, 1), (torch.stack(laws, 1) if laws else None)


class DominoDrafter(DFlashDrafter):
    """DFlash's block pass, then the GRU stepped on the drafts, the correction added slot by slot."""

    def _walk(self, hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor, sampling: Sampling,
              states: list[DFlashState], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        return (*domino_walk(self.head, self.embed, hidden, logits, roots, sampling), lengths)


DRAFTER = DominoDrafter
