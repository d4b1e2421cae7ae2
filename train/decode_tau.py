"""Decode τ: the τ a head reaches when it drafts as the generator makes it draft, measured while training.

Simulated τ (``train.metrics``) lets every draft step read the data's true previous token (teacher
forcing) and a fixed number of steps: on the demo it read 5.8-6.0 for heads whose real τ ranged from
3.3 to 4.6 (issue 45). Here the head drafts from its own previous drafts, through the drafter and the
draft shape ``SpeculativeGenerator`` builds for it by default (on CPU EAGLE's adaptive chain: from 4,
+2 after a fully accepted step, -1 otherwise), and each step is verified against the target's greedy
continuation of held-out prompts.

Greedy speculative decoding emits the target's greedy continuation whatever the drafts, so verifying
needs no target forward per step: the continuation (``target.generate``, once per run) and the target's
features along it (one forward, once per run) are all a verify would return. A step accepts the leading
drafts equal to the continuation (of a tree: its first longest such path, as ``greedy_accept_rows``), the
bonus is the continuation's next token, the drafter observes the features of the accepted tokens, and a
row ends at its first EOS or after ``max_new_tokens``, as the generator's do. τ is the generator's: the
tokens emitted by verification steps over the number of steps, summed over the prompts, each decoded
alone (``GenerationStats.tau`` of one ``generate`` per prompt, pooled). The one difference from a real
decode: the features come from one forward over prompt + continuation instead of the verify forwards'
chunks, equal up to float rounding (tests/train/test_decode_tau.py checks the two τ equal on tiny heads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.infer.drafters import ByTemperature, Drafter, Sampling, adaptive_chain, make_drafter
from draftsmith.target.recurrent import is_hybrid
from draftsmith.target.model import target_forward

GREEDY = Sampling()


@dataclass
class DecodeRow:
    """One held-out prompt and what the target does with it."""

    prompt_length: int
    sequence: Tensor  # (1, P + n) the prompt, then the target's greedy continuation up to its first EOS
    features: Tensor | None = None  # (1, P + n, F) the target's features along ``sequence`` (``with_features``)


@dataclass
class DecodeSet:
    """The held-out prompts a run decodes at every evaluation, with the target's greedy continuations."""

    rows: list[DecodeRow]
    max_new_tokens: int


def default_drafter(head: nn.Module, target: nn.Module) -> Drafter:
    """The drafter ``SpeculativeGenerator(target, head)`` drafts with when given no draft shape: the kind's
    default on the target's device (``make_drafter``), a hybrid target's adaptive chain, eager."""
    drafter = adaptive_chain(head, target) if is_hybrid(target) else make_drafter(head, target)
    drafter.compile_with(False)
    return drafter


def head_drafter(head: nn.Module, target: nn.Module) -> Drafter:
    """The drafter decode τ measures a head with at every temperature: ``default_drafter``, whose length policy
    at temperature > 0 (the CPU default's cost-aware chain, ``ByTemperature``) is replaced by its greedy one (the
    adaptive chain): the cost-aware choice follows this machine's measured step costs, not the head, and drafts
    nothing on most sampled steps of a weak head, so τ would rank machines instead of heads."""
    drafter = default_drafter(head, target)
    return drafter.greedy if isinstance(drafter, ByTemperature) else drafter


def not_decodable(drafter: Drafter) -> str | None:
    """Why decode τ cannot replay this drafter without the target (None: it can)."""
    if drafter.entry_model is not None:
        return f"{type(drafter).__name__} drafts into the target's own cache"
    return None


def greedy_continuations(target: nn.Module, prompts: list[Tensor], max_new_tokens: int) -> list[DecodeRow]:
    """Each prompt (1, P) with the target's greedy continuation (``target.generate``, one prompt at a time,
    as ``infer.generate_command --compare`` runs it), cut after the first EOS of the target's generation config."""
    config = getattr(target, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else eos[0] if eos else 0
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                  do_sample=False, pad_token_id=pad)
            new = out[0, prompt.shape[1]:]
            stops = torch.isin(new, torch.tensor(eos, dtype=new.dtype, device=new.device)).nonzero()
            if len(stops):
                new = new[: int(stops[0, 0]) + 1]
            rows.append(DecodeRow(prompt.shape[1], torch.cat([prompt[0], new])[None]))
    return rows


def with_features(target: nn.Module, rows: list[DecodeRow], aux_layer_ids: tuple[int, ...]) -> None:
    """Fill each row's ``features``: what the generator's ``_features`` reads (the aux layers' states, or the
    final hidden state for a drafter that reads none), from one target forward over the row."""
    with torch.no_grad():
        for row in rows:
            out = target_forward(target, row.sequence, aux_layer_ids=aux_layer_ids, compute_logits=False)
            row.features = out.aux_hidden if aux_layer_ids else out.final_hidden


def accepted_drafts(tokens: Tensor, retrieve_indices: Tensor, wanted: Tensor) -> int:
    """How many drafts a greedy verify accepts: the longest run of leading drafts along a path of the draft
    (tokens (N,), root first; retrieve_indices (P, D+1) padded with -1) equal to ``wanted`` (the
    continuation after the root; a path longer than it matches up to its end only)."""
    paths = retrieve_indices[:, 1:]  # (P, D) the drafts' nodes, root left out
    depth = min(paths.shape[1], wanted.shape[0])
    drafted = tokens[paths[:, :depth].clamp(min=0)]  # (P, depth)
    match = (drafted == wanted[None, :depth]) & (paths[:, :depth] >= 0)
    return int(match.long().cumprod(dim=1).sum(dim=1).max()) if depth else 0


def decode_row(drafter: Drafter, row: DecodeRow, max_new_tokens: int) -> tuple[int, int]:
    """(verification steps, tokens they emitted) of greedily decoding ``row``'s prompt with ``drafter``: the
    generator's loop (``SpeculativeGenerator.start``/``step``/``_settle``) with the verify read off the
    continuation."""
    p, seq, feats = row.prompt_length, row.sequence, row.features
    total = seq.shape[1] - p  # the tokens the decode emits (the first one by the prefill, not a step)
    drafter.begin(GREEDY)  # as the generator's start: a drafter whose policy follows the sampling mode picks greedy
    state = drafter.new_rows([seq[:, :p]], [p + max_new_tokens])
    if total > 1:
        drafter.observe_rows(state, [feats[:, :p]], [seq[:, 1: p + 1]])
    emitted, steps, step_tokens = 1, 0, 0
    while emitted < total:
        root = p + emitted - 1  # position of the last emitted token: the next draft's root
        draft = drafter.propose_rows(state, [seq[0, root]], GREEDY, [max_new_tokens - emitted - 1])[0]
        run = accepted_drafts(draft.tokens, draft.tree.retrieve_indices, seq[0, root + 1:])
        kept = min(run + 1, total - emitted)  # the accepted drafts and the bonus, cut at EOS / the budget
        steps, step_tokens, emitted = steps + 1, step_tokens + kept, emitted + kept
        if emitted < total:  # the accepted nodes: the root and its run of drafts
            drafter.observe_rows(state, [feats[:, root: root + run + 1]], [seq[:, root + 1: root + run + 2]])
    return steps, step_tokens


@torch.no_grad()
def row_counts(drafter: Drafter, decode_set: DecodeSet) -> list[tuple[int, int]]:
    """(verification steps, tokens they emitted) of each row of ``decode_set``, each decoded alone."""
    return [decode_row(drafter, row, decode_set.max_new_tokens) for row in decode_set.rows]


def decode_counts(drafter: Drafter, decode_set: DecodeSet) -> tuple[int, int]:
    """(verification steps, tokens they emitted) over every row of ``decode_set``, each decoded alone."""
    counts = row_counts(drafter, decode_set)
    return sum(s for s, _ in counts), sum(t for _, t in counts)


def decode_tau(steps: float, tokens: float) -> float:
    """τ as ``GenerationStats.tau``: tokens per verification step (0.0 before any step)."""
    return tokens / steps if steps else 0.0
