"""A hybrid target's rollback: its recurrent states put back to exactly the accepted tokens after a partial accept.

A verify runs a chain through the recurrent layers, whose states then hold every verified token, rejected ones
too. A ``Rollback`` is the generator's one hook for that, called three times per step, and the context of its
verify forward (``recording()``):
- ``before_draft(dec)``: the states to roll back to (a checkpoint taken before anything of the step runs: a
  drafter sharing the target's cache, layer skip, writes states while drafting);
- ``before_verify(dec, drafts, before)``: what the verify runs (``Verify``: the drafts, or the tokens a row
  carries pending in front of them, and from which slots);
- ``after_accept(dec, verify, new, accepted, width)``: each row's states after exactly the tokens it keeps.

One implementation per rule (docs/hybrid.md): ``Recorded`` ("recorded": the verify keeps every position's states,
``target.positions``, and each row keeps its accepted one's; its ``recording()`` is the verify forward's context),
``Replay`` ("replay": restore the checkpoint, then one more forward over the accepted tokens through the layers up to
the last recurrent one) and ``Merged`` ("merged": restore, and run the accepted tokens again in front of the next
step's draft, in its verify), all subclasses of ``Rollback``, the hook itself, whose defaults roll nothing back: an
attention-only target gets a plain ``Rollback()``, which verifies the drafts as they are and keeps nothing.
``make_rollback`` picks one. A new rule is a subclass here and a name in ``RULES``.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from draftsmith.heads.common import text_config
from draftsmith.infer.decoding import Decoding, GenerationStats
from draftsmith.infer.drafters.base import Draft, Drafter, chain_buffers
from draftsmith.target.views import shallow_backbone
from draftsmith.target.cache_keywords import cache_kwargs
from draftsmith.infer.masked_forward import attention_masks, verify_key_positions, verify_mask
from draftsmith.target import positions
from draftsmith.target.delta_rule import records_positions
from draftsmith.target.recurrent import RECURRENT_LAYER_TYPES, Checkpoint, layer_types
from draftsmith.target.model import backbone_of
from draftsmith.infer.cache import StaticKVCache

RULES = ("recorded", "merged", "replay")
# rollback="merged": the most tokens a row carries pending into the next verify (they widen it); past this,
# or when a batch's rows disagree, they are replayed at once (docs/hybrid.md)
MAX_PENDING = 16


@dataclass
class Verify:
    """What one step's verify runs, from ``Rollback.before_verify``."""

    drafts: list[Draft]  # per row: its draft, behind the tokens it carries pending (if any)
    starts: Tensor  # (B,) each row's first verified slot
    skip: int = 0  # leading output positions of every row that are its pending tokens, not its draft
    before: Checkpoint | None = None  # the recurrent states before the step's tokens (None: no rollback)
    since: Tensor | None = None  # (B, skip + 1) each row's tokens since ``before`` up to its root


@dataclass
class Pending:
    """``Merged``'s carry: each row's accepted ``tokens`` (B, p) whose KV is in the cache (slots lengths - p ..)
    but whose recurrent states are not: they were restored to ``before``, taken before those tokens."""

    tokens: Tensor
    before: Checkpoint


class Rollback:
    """The generator's rollback hook; as it is, for an attention-only target (its KV is compacted to the accepted
    tokens, no state needs rolling back): no checkpoint, the drafts verified as they are, nothing put back."""

    rule: str | None = None

    def before_draft(self, dec: Decoding) -> Checkpoint | None:
        return None

    def before_verify(self, dec: Decoding, drafts: list[Draft], before: Checkpoint | None) -> Verify:
        return Verify(drafts, dec.state.lengths)

    def after_accept(self, dec: Decoding, verify: Verify, new: Tensor, accepted: list[int], width: int) -> None:
        """Nothing to put back."""

    def check_drafts(self, drafts: list[Draft], target: nn.Module) -> None:
        """Any tree verifies."""

    def recording(self) -> AbstractContextManager:
        """The context of the verify forward (``Recorded``: every position's states kept)."""
        return nullcontext()


class Replay(Rollback):
    """rollback="replay": restore the checkpoint, then run each row's accepted tokens through the target again.

    ``route`` is the generator's context around every verify and replay forward (the per-token Gated DeltaNet
    rule, ``SpeculativeGenerator.routed``)."""

    rule = "replay"

    def __init__(self, target: nn.Module, route: Callable[[], AbstractContextManager]) -> None:
        self.target, self.route = target, route
        self.dtype = target.get_input_embeddings().weight.dtype
        self._stack: nn.Module | None = None

    def before_draft(self, dec: Decoding) -> Checkpoint:
        return dec.state.cache.states.checkpoint()

    def before_verify(self, dec: Decoding, drafts: list[Draft], before: Checkpoint | None) -> Verify:
        roots = torch.stack([d.tokens[0] for d in drafts])[:, None]
        return Verify(drafts, dec.state.lengths, 0, before, roots)

    def after_accept(self, dec: Decoding, verify: Verify, new: Tensor, accepted: list[int], width: int) -> None:
        """``roll`` each row's tokens since the checkpoint: its pending ones, its root, its accepted drafts."""
        tokens = torch.cat([verify.since, new[:, : max(accepted) - 1]], dim=1)  # (B, p + max a)
        kept = [verify.skip + a if a else 0 for a in accepted]  # 0: a row that had stopped before this step
        self.roll(dec, verify.before, tokens, kept, width, verify.starts)
        dec.instruments.clock.mark("rollback")

    def check_drafts(self, drafts: list[Draft], target: nn.Module) -> None:
        for d in drafts:
            if d.tree.retrieve_indices.shape != (1, d.tokens.shape[0]):
                raise ValueError(f"{type(target).__name__} is a hybrid (recurrent layers read a verify's tokens "
                                 "as one sequence): drafts must be chains (tree=Chain(n), or no tree), not trees")

    def roll(self, dec: Decoding, before: Checkpoint, tokens: Tensor, kept: list[int], width: int,
             starts: Tensor) -> None:
        """Leave each live row's recurrent states after exactly the tokens it keeps: ``tokens`` (B, T) are each
        row's tokens since ``before`` (pending ones, root, accepted drafts), of which row b keeps ``kept[b]``;
        the verify ran ``width`` positions per row from slot ``starts[b]``. A row that kept all ``width``
        holds the verify's states (its padding, if any, came after them: it never keeps a padded state); the
        others' are replayed."""
        dec.state.carry = None
        short = _short_rows(dec, kept, width)
        if short:
            self.replay(dec.state.cache, before, tokens, short, starts, dec.state.pads, dec.stats)

    def replay(self, cache: StaticKVCache, before: Checkpoint, tokens: Tensor, short: dict[int, int],
               starts: Tensor, pads: Tensor, stats: GenerationStats) -> None:
        """Put row b's recurrent states after its first ``short[b]`` ``tokens`` (B, T), whose KV sits at slots
        ``starts[b]``..: for each distinct length a, the states from ``before`` are restored and the first a
        tokens of every row run through the target again (one [B, a] forward, whose attention rewrites the
        same KV at the same slots); rows keeping a take that forward's states. Rows not in ``short`` keep
        the states they hold now."""
        after = cache.states.checkpoint()  # the verify's states: rows that kept every position
        device = tokens.device
        kept = torch.tensor([short.get(b, 0) for b in range(tokens.shape[0])], device=device)
        stack = self.stack()
        for a in sorted(set(short.values())):
            cache.states.restore(before)
            offsets = torch.arange(a, device=device)[None]
            slots = starts[:, None] + offsets  # (B, a) the accepted path's slots
            positions = (starts - pads)[:, None] + offsets
            causal = torch.ones(a, a, dtype=torch.bool, device=device).tril_().expand(tokens.shape[0], a, a)
            width = cache.length + a
            cache.window = width
            mask = attention_masks(text_config(self.target), verify_mask(starts, pads, causal, width, self.dtype),
                                   positions, verify_key_positions(starts, pads, positions, width))
            cache.slots = slots
            with self.route():
                stack(input_ids=tokens[:, :a], attention_mask=mask, position_ids=positions, use_cache=True,
                      **cache_kwargs(stack, cache))
            stats.replays += 1
            stats.replayed_tokens += a * tokens.shape[0]
            after.take_rows(cache.states.current(), kept == a)
        cache.states.restore(after)

    def stack(self) -> nn.Module:
        """What a replay runs: the target's decoder stack up to its last recurrent layer, a view sharing its
        layers (no later layer, final norm or lm_head: the replay wants states, not outputs)."""
        if self._stack is None:
            types = layer_types(self.target)
            last = max(i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES)
            self._stack = shallow_backbone(self.target, last + 1) if last + 1 < len(types) else backbone_of(self.target)
        return self._stack


class Recorded(Rollback):
    """rollback="recorded": the verify keeps every position's recurrent state (``target.positions``) and each row
    keeps the state after its accepted tokens: no checkpoint, nothing pending, nothing run again; rows may keep
    different counts. Chains only, as every hybrid rollback."""

    rule = "recorded"

    def __init__(self) -> None:
        self._record = False

    def before_verify(self, dec: Decoding, drafts: list[Draft], before: Checkpoint | None) -> Verify:
        self._record = max(d.tokens.shape[0] for d in drafts) > 1  # a verify of one token keeps all it runs
        return Verify(drafts, dec.state.lengths)

    def recording(self) -> AbstractContextManager:
        return positions.recording() if self._record else nullcontext()

    def after_accept(self, dec: Decoding, verify: Verify, new: Tensor, accepted: list[int], width: int) -> None:
        if self._record:  # off again: a verify outside a step (``SpeculativeGenerator.verify``) records nothing
            self._record = False
            live = set(dec.live())
            dec.state.cache.states.keep([a if b in live else 0 for b, a in enumerate(accepted)])
        dec.instruments.clock.mark("rollback")

    check_drafts = Replay.check_drafts


class Merged(Replay):
    """rollback="merged": restore the checkpoint and carry the accepted tokens into the next verify, which runs
    them again in front of its draft; when rows disagree on how many they keep, or past ``MAX_PENDING``, replay."""

    rule = "merged"

    def before_draft(self, dec: Decoding) -> Checkpoint:
        pending = dec.state.carry  # tokens pending: their states were restored to that checkpoint already
        return pending.before if pending is not None else super().before_draft(dec)

    def before_verify(self, dec: Decoding, drafts: list[Draft], before: Checkpoint | None) -> Verify:
        """The pending tokens again, in front of each live row's draft (a finished row verifies its root alone,
        at its own length)."""
        pending = dec.state.carry
        if pending is None:
            return super().before_verify(dec, drafts, before)
        live, p = dec.live(), pending.tokens.shape[1]
        verified = [_after_pending(pending.tokens[b], d) if b in live else d for b, d in enumerate(drafts)]
        is_live = torch.zeros_like(dec.state.lengths)
        is_live[live] = 1
        dec.stats.pending_tokens += p * len(live)
        roots = torch.stack([d.tokens[0] for d in drafts])[:, None]
        return Verify(verified, dec.state.lengths - p * is_live, p, before, torch.cat([pending.tokens, roots], dim=1))

    def roll(self, dec: Decoding, before: Checkpoint, tokens: Tensor, kept: list[int], width: int,
             starts: Tensor) -> None:
        """As ``Replay.roll``, except that when every live row keeps the same q < width tokens (always for one
        row; at most ``MAX_PENDING``), the states go back to ``before`` and those q tokens become the next
        verify's pending ones."""
        dec.state.carry = None
        short = _short_rows(dec, kept, width)
        lengths = set(short.values())
        if short and len(short) == len(dec.live()) and len(lengths) == 1 and max(lengths) <= MAX_PENDING:
            dec.state.cache.states.restore(before)
            dec.state.carry = Pending(tokens[:, : max(lengths)], before)
        elif short:
            self.replay(dec.state.cache, before, tokens, short, starts, dec.state.pads, dec.stats)


def _short_rows(dec: Decoding, kept: list[int], width: int) -> dict[int, int]:
    """The live rows that keep some but not all of the ``width`` verified positions: {row: tokens kept}."""
    live = set(dec.live())
    return {b: k for b, k in enumerate(kept) if b in live and 0 < k < width}


def _after_pending(pending: Tensor, draft: Draft) -> Draft:
    """``draft`` (a chain) behind a row's ``pending`` (p,) tokens: one chain of p + N nodes to verify."""
    tokens = torch.cat([pending, draft.tokens])
    return Draft(tokens, chain_buffers(tokens.shape[0] - 1, tokens.device))


def make_rollback(rule: str | None, target: nn.Module, hybrid: bool, compile: bool | str, drafter: Drafter,
                  route: Callable[[], AbstractContextManager], routes: tuple = ()) -> Rollback:
    """The generator's rollback: ``rule`` checked on every target ("recorded", "merged", "replay" or None); an
    attention-only target gets a plain ``Rollback`` (nothing to roll back). "recorded" and "merged" need an eager
    verify (a compiled one has one shape: recording grows the conv windows, pending tokens widen it) and a drafter
    that does not draft into the target's cache (layer skip's shared KV: its draft writes the states the verify
    starts from); "recorded" also needs every recurrent layer's rule routed where it records
    (``target.delta_rule.records_positions`` over the generator's ``routes``). None = the first of them that
    applies."""
    if rule not in (None, *RULES):
        raise ValueError(f"rollback must be 'recorded', 'merged', 'replay' or None, got {rule!r}")
    why = ("compile is on (a compiled verify has one shape)" if compile else
           f"{type(drafter).__name__} drafts into the target's cache" if drafter.entry_model is not None else None)
    if rule in ("recorded", "merged") and why is not None and hybrid:
        raise ValueError(f"rollback={rule!r} cannot run here: {why}; use rollback='replay' or None")
    if not hybrid:
        return Rollback()
    recordable = records_positions(target, routes)
    if rule == "recorded" and not recordable:
        raise ValueError(f"rollback='recorded' cannot run on {type(target).__name__}: its recurrent layers' rules are "
                         "not routed where they keep every position's state (docs/hybrid.md); use 'merged' or None")
    rule = rule or ("replay" if why is not None else "recorded" if recordable else "merged")
    return Recorded() if rule == "recorded" else (Merged if rule == "merged" else Replay)(target, route)


__all__ = ["MAX_PENDING", "RULES", "Merged", "Pending", "Recorded", "Replay", "Rollback", "Verify", "make_rollback"]
