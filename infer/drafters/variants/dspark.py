"""DSpark's drafter (``head.variant=dspark``): DFlash's, walking the block with the Markov bias.

Slot k's logits get the Markov bias of the token chosen at slot k-1 (the root for slot 0), so the walk
is sequential over the block's slots: greedy takes each corrected argmax, sampling draws each slot from
its corrected law q_k (returned, for the generator's min(1, p/q) chain check). Each slot's confidence
logit reads the same previous token. Adaptive verification: a row keeps its drafts up to the first slot
whose sigmoid(confidence) is below the threshold (``heads.variants.dspark.confident_lengths``). Under a cost-aware
chooser (``chosen_chain``, ``--choose``) and no threshold given, the cut weighs the confidences against the measured
step costs instead (``cost_cut``: the prefix with the most expected tokens per second, the confidences read as each
slot's acceptance given the slots before it, as the head is trained: BCE against sum min(p, q)). Either choice
depends on the drafts only, never on the target, so the chain check stays lossless.
"""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.variants.dspark import DEFAULT_CONFIDENCE_THRESHOLD, confident_lengths, corrected
from draftsmith.infer.cost_model import StepCosts
from draftsmith.infer.drafters.base import Sampling
from draftsmith.infer.drafters.dflash import DFlashDrafter, DFlashState


def markov_walk(head: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, root: torch.Tensor,
                sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(tokens (R, n), laws (R, n, V) or None when greedy, confidence logits (R, n)) of a DSpark walk.

    hidden (R, n, H): the head's normed outputs of slots 0..n-1; logits (R, n, V) float32 their lm_head
    logits; root (R,): the token before slot 0."""
    tokens, laws, confidence, previous = [], [], [], root
    for k in range(logits.shape[1]):
        out = corrected(head.markov_head, head.confidence_head, hidden[:, k], logits[:, k], previous)
        confidence.append(out.confidence)
        if sampling.greedy:
            previous = out.logits.argmax(-1)
        else:
            law = sampling.probs(out.logits)  # (R, V)
            laws.append(law)
            previous = torch.multinomial(law, 1)[:, 0]
        tokens.append(previous)
    return torch.stack(tokens, 1), (torch.stack(laws, 1) if laws else None), torch.stack(confidence, 1)


def cost_cut(accept: list[float], costs: StepCosts, drafted: int) -> int:
    """How many of ``drafted`` slots to verify: the k in 0..drafted with the most expected tokens per second,
    E(k) = 1 + a_1 + a_1 a_2 + ... over ``costs.after_drafting(k, drafted)`` (the block is drafted already: its
    cost is paid whatever k), the shorter on a tie; ``accept``: each slot's acceptance given the ones before."""
    best, best_rate, expected, survive = 0, 1.0 / costs.after_drafting(0, drafted), 1.0, 1.0
    for k in range(1, drafted + 1):
        survive *= accept[k - 1]
        expected += survive
        rate = expected / costs.after_drafting(k, drafted)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class DSparkDrafter(DFlashDrafter):
    """DFlash's block pass, then the Markov walk and each row's confident prefix (``confidence``: the threshold of
    adaptive verification, None = ``DEFAULT_CONFIDENCE_THRESHOLD``, or the cost-aware cut under a chooser's step
    costs; 0 = keep every draft)."""

    def _set_confidence(self, confidence: float | None) -> None:
        if confidence is not None and not 0 <= confidence < 1:
            raise ValueError(f"confidence={confidence}: DSpark's threshold on the acceptance confidence lies in [0, 1)")
        self.threshold = DEFAULT_CONFIDENCE_THRESHOLD if confidence is None else confidence
        self.by_cost = confidence is None  # under a chooser's step costs, the cut weighs them (``cost_cut``)
        self.chosen, self.costs = False, None  # under a chooser; its costs (None: its profile forces every length)

    def use_step_costs(self, costs: StepCosts | None) -> bool:
        self.chosen, self.costs = True, costs
        return self.by_cost and costs is not None

    def _walk(self, hidden: torch.Tensor, logits: torch.Tensor, roots: torch.Tensor, sampling: Sampling,
              states: list[DFlashState], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        chain, law, confidence = markov_walk(self.head, hidden, logits, roots, sampling)
        if self.by_cost and self.chosen:
            if self.costs is None:  # the chooser's profile: the lengths it forces, whole
                return chain, law, lengths
            accept = confidence.sigmoid().tolist()
            return chain, law, [cost_cut(accept[s.row], self.costs, n) for s, n in zip(states, lengths)]
        keep = confident_lengths(confidence, self.threshold).tolist()
        return chain, law, [min(n, keep[s.row]) for s, n in zip(states, lengths)]


DRAFTER = DSparkDrafter
