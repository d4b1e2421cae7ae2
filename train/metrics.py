"""Held-out acceptance metrics: per-step top-1 accuracy, conditional accuracy and simulated τ.

Alignment as in ``train.losses``: draft step k at position i drafts token i+2+k and is correct when
its top-1 equals the target's top-1 at position i+1+k (what greedy verification checks). A
(step, position) counts when token i+2+k has ``loss_mask = 1``; the chain for position i counts
when all of its K steps do. Drafts condition on ground-truth tokens (teacher forcing), so this
simulates greedy decoding on data the target would itself produce (exact for self-distilled data).
"""
from __future__ import annotations

import torch
from torch import Tensor


def acceptance_rate(draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """(...) the exact chance that a token sampled from q = softmax(draft_logits) (..., V) passes speculative
    sampling's min(1, p/q) test against p = target_probs (..., V): sum_v min(p_v, q_v) (Leviathan et al. 2023;
    the quantity the LK losses train). Logged per draft position while training (``train_accept``)."""
    return torch.minimum(draft_logits.float().softmax(-1), target_probs.float()).sum(-1)


def step_correctness(draft_top1: Tensor, target_top1: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(correct, valid), both (K, B, T-2) bool, from draft_top1 (K, B, T) target ids,
    target_top1 (B, T) and loss_mask (B, T); entry [k, b, i] is draft step k at position i."""
    num_steps, batch, seq_len = draft_top1.shape
    n = max(seq_len - 2, 0)
    correct = torch.zeros(num_steps, batch, n, dtype=torch.bool, device=draft_top1.device)
    valid = torch.zeros_like(correct)
    for k in range(num_steps):
        m = max(seq_len - 2 - k, 0)  # positions whose drafted token i+2+k exists
        correct[k, :, :m] = draft_top1[k, :, :m] == target_top1[:, 1 + k: 1 + k + m]
        valid[k, :, :m] = loss_mask[:, 2 + k: 2 + k + m].bool()
    return correct, valid


class AcceptanceMeter:
    """Accumulates step correctness; ``state`` is a flat tensor so processes can sum it."""

    def __init__(self, num_steps: int, device: torch.device | str = "cpu") -> None:
        self.num_steps = num_steps
        # [correct_k, valid_k, chain_k, chain_prev_k] per step, then [accepted, chains]
        self.state = torch.zeros(4 * num_steps + 2, dtype=torch.float64, device=device)

    def update(self, correct: Tensor, valid: Tensor) -> None:
        """Add (K, ...) bool ``correct`` / ``valid`` tensors (see ``step_correctness``)."""
        c, v = correct.flatten(1), valid.flatten(1)  # (K, N)
        prefix_valid = v.cumprod(0).bool()  # valid at every step <= k
        prefix_correct = c.cumprod(0).bool()  # correct at every step <= k
        prev_correct = torch.cat([torch.ones_like(c[:1]), prefix_correct[:-1]])  # correct at every step < k
        all_valid = prefix_valid[-1]  # (N,)
        stats = torch.cat([
            (c & v).sum(1), v.sum(1),
            (prefix_valid & prefix_correct).sum(1), (prefix_valid & prev_correct).sum(1),
            (prefix_correct & all_valid).sum().reshape(1), all_valid.sum().reshape(1),
        ])
        self.state += stats.to(self.state)

    def compute(self) -> dict:
        """acc (list), cond_acc (list), tau = 1 + mean accepted run length, positions."""
        k = self.num_steps
        correct, valid, chain, chain_prev = self.state[:4 * k].view(4, k)
        accepted, chains = self.state[4 * k:].tolist()
        acc = (correct / valid.clamp(min=1)).tolist()
        cond_acc = (chain / chain_prev.clamp(min=1)).tolist()
        tau = 1 + accepted / chains if chains else float("nan")
        return {"acc": acc, "cond_acc": cond_acc, "tau": tau, "positions": int(chains)}


def format_decoding(metrics: dict) -> str:
    """The record's decode τ at each temperature (``train.eval_temperature``), e.g. ``decode tau 3.10 [2.85, 3.35]
    (496 tokens in 160 steps) | decode tau T=1 1.52 [1.41, 1.63] (...) | `` (the 95% interval where there is one)."""
    parts = []
    for key in metrics:
        if not (key == "decode_tau" or key.startswith("decode_tau_t")) or key.endswith(("_low", "_high")):
            continue
        suffix = key[len("decode_tau"):]  # "" or "_t<T>"
        label = f"decode tau T={suffix[2:]}" if suffix else "decode tau"
        ci = f" [{metrics[key + '_low']:.3f}, {metrics[key + '_high']:.3f}]" if key + "_low" in metrics else ""
        parts.append(f"{label} {metrics[key]:.3f}{ci} ({metrics['decode_tokens' + suffix]} tokens in "
                     f"{metrics['decode_steps' + suffix]} steps) | ")
    return "".join(parts)


def format_acceptance(metrics: dict) -> str:
    """One human-readable line, e.g. ``decode tau 3.10 (... steps) | simulated tau 2.31 | acc_k 0.62 0.41 ... |
    cond_acc_k 0.62 0.58 ...`` (decode τ where the record has it: ``train.decode_tau``)."""
    acc = " ".join(f"{a:.3f}" for a in metrics["acc"])
    cond = " ".join(f"{a:.3f}" for a in metrics["cond_acc"])
    line = (f"{format_decoding(metrics)}simulated tau {metrics['tau']:.3f} | acc_k {acc} | cond_acc_k {cond} "
            f"({metrics['positions']} positions)")
    if "draft_temperature" in metrics:
        line += (" | draft temperature " + " ".join(f"{s:.2f}" for s in metrics["draft_temperature"])
                 + " (sampled accept_k " + " ".join(f"{a:.3f}" for a in metrics["sampled_accept"]) + ", at 1: "
                 + " ".join(f"{a:.3f}" for a in metrics["sampled_accept_untempered"]) + ")")
    return line
