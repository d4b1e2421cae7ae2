"""Sampled decodes that repeat: each prompt decoded under its own fixed seed, and τ's interval over prompts.

At temperature > 0 what a head accepts depends on the draws, so one τ is one sample. ``seeded_generate`` seeds
torch's generator from the prompt's tokens (``prompt_seed``) before the call and restores the caller's state
after it: the same head, prompt and seed give the same decode (and the same ``GenerationStats``) wherever it
runs, in training's evaluation (``train.eval_temperature``) as in ``draftsmith rank-heads`` and ``bench``, and
the caller's own random stream (a training run's) is left as it was. ``tau_interval`` states how far τ pooled over
prompts can be trusted: a 95% interval from the spread of the prompts' (steps, tokens) around the pooled ratio
(the ratio estimator's linearised variance), built from sums alone so that processes can add theirs first.
"""
from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

from draftsmith.infer.decoding import GenerationStats

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


def prompt_seed(prompt: Tensor, seed: int = 0) -> int:
    """The seed a prompt (1, P) is decoded under: a CRC of its token ids plus ``seed``, below 2**31."""
    ids = prompt.detach().reshape(-1).to("cpu", torch.int64).numpy().tobytes()
    return (zlib.crc32(ids) + int(seed)) % 2 ** 31


def seeded_generate(gen, prompt: Tensor, seed: int = 0, **options) -> Tensor:
    """``gen.generate(prompt, **options)`` with torch's generators (CPU, and the generator's CUDA device) seeded
    by ``prompt_seed(prompt, seed)``, the caller's random state restored afterwards. ``gen.last_stats`` is the
    call's."""
    device = torch.device(getattr(gen, "device", "cpu"))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(prompt_seed(prompt, seed))
        return gen.generate(prompt, **options)


def interval_sums(counts: list[tuple[int, int]]) -> list[float]:
    """[prompts, Σ steps, Σ tokens, Σ steps², Σ tokens², Σ steps·tokens] of per-prompt (steps, tokens): what
    ``tau_interval`` needs, summable over processes."""
    return [float(len(counts)), float(sum(s for s, _ in counts)), float(sum(t for _, t in counts)),
            float(sum(s * s for s, _ in counts)), float(sum(t * t for _, t in counts)),
            float(sum(s * t for s, t in counts))]


def tau_interval(sums: list[float], z: float = Z95) -> tuple[float, float | None, float | None]:
    """(τ = Σ tokens / Σ steps, low, high): τ ± z standard errors, the error from the prompts' residuals
    tokens_i - τ·steps_i (variance n/(n-1)·Σ residual² / (Σ steps)²). (τ, None, None) below two prompts;
    (0.0, None, None) before any step."""
    n, steps, tokens, ss, tt, st = sums
    if not steps:
        return 0.0, None, None
    tau = tokens / steps
    if n < 2:
        return tau, None, None
    residual = max(tt - 2 * tau * st + tau * tau * ss, 0.0)
    half = z * math.sqrt(n / (n - 1) * residual) / steps
    return tau, tau - half, tau + half


def seeded_stats(gen, prompts: list[Tensor], seed: int = 0, **options) -> tuple[list[Tensor], list[GenerationStats]]:
    """Each prompt (1, P) decoded alone by ``seeded_generate``: (the outputs, each call's ``GenerationStats``).
    Pool the stats with ``GenerationStats.pooled`` (counts summed before any ratio)."""
    outs, stats = [], []
    for prompt in prompts:
        outs.append(seeded_generate(gen, prompt, seed, **options))
        stats.append(gen.last_stats)
    return outs, stats


def tau_report(stats: list[GenerationStats], key: str = "tau") -> dict:
    """τ of per-call ``GenerationStats`` pooled, with its interval over the calls (``key``, ``key_low``,
    ``key_high``), tokens/s over the summed wall time, and vLLM's acceptance names (``GenerationStats.acceptance``)."""
    pooled = GenerationStats.pooled(stats)
    tau, low, high = tau_interval(interval_sums([(s.steps, s.step_tokens) for s in stats]))
    return {key: tau, f"{key}_low": low, f"{key}_high": high, "tokens_per_s": pooled.tokens_per_s,
            "steps": pooled.steps, "step_tokens": pooled.step_tokens, **pooled.acceptance()}
