"""Hierarchical drafting: a draft LM whose own drafts are drafted by n-grams or by a head trained on
the draft LM, lossless at both levels.

The outer level is ``LMDrafter``'s: the draft LM drafts a chain that the target verifies. Inside, the
draft LM itself decodes speculatively: the inner level guesses the draft LM's next tokens (prompt
lookup over prompt + output + the chain so far, or a head drafting a greedy chain from the draft LM's
own features), the draft LM reads all guesses in one forward, and its own rule decides each token
(greedy: its argmax; sampling: a guess ``g`` is kept with probability ``q(g)``, else the token is
drawn from ``q`` without ``g``, renormalised; either way the token's law is exactly ``q``). So the
chain is token for token the one the draft LM drafts alone (greedy) or has its law (sampling), and
``q`` goes to the target's min(1, p/q) rule as usual; only the number of draft-LM forwards changes.

Rejected guesses are cut from the draft LM's cache, and so are tokens the target rejected. A head at
the inner level is cut back with it: it has read (the draft LM's feature at token i, token i + 1) for
the kept tokens only (``HeadDrafter.rewind_rows``), and reads the pairs after them before it guesses again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.infer.drafters.base import Chain, Draft, HeadDrafter, Sampling, chain_draft, root_only
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter, LMState
from draftsmith.infer.drafters.free.ngram import NgramDrafter, find_continuations
from draftsmith.target.cache_keywords import cache_kwargs
from draftsmith.target.model import target_forward

GREEDY = Sampling()


@dataclass
class HierarchicalState(LMState):
    feats: Tensor | None = None  # (C, F) the draft LM's features of the cached tokens (a head inner level)
    inner: Any = None  # the inner head's state
    observed: int = 0  # pairs the inner head has read: (feats[i], cached[i + 1]) for i < observed


class HierarchicalDrafter(LMDrafter):
    """``LMDrafter(model, target, tree)`` whose draft LM decodes with ``inner``: an ``NgramDrafter``
    (its ``max_ngram``, ``min_ngram`` and ``length`` guesses per draft-LM forward; one branch) or the
    drafter of a head trained on the draft LM (``make_drafter(head, model, Chain(n))``: n guesses per
    draft-LM forward)."""

    def __init__(self, model: nn.Module, target: nn.Module, inner: NgramDrafter | HeadDrafter | None = None,
                 tree: Chain | None = None) -> None:
        super().__init__(model, target, tree)
        if self.hybrid:  # its rounds cut the draft LM's cache back mid-draft, which a recurrent state cannot be
            raise ValueError(f"{type(model).__name__} keeps recurrent states: hierarchical drafting needs an attention "
                             "draft LM (a hybrid draft LM drafts with LMDrafter, rolled back by checkpoint)")
        self.inner = inner or NgramDrafter()
        if isinstance(self.inner, HeadDrafter):
            if not isinstance(self.inner.option, Chain):
                raise TypeError(f"the inner head guesses a Chain, not {type(self.inner.option).__name__}")
            if type(self.inner).rewind_rows is HeadDrafter.rewind_rows:
                raise TypeError(f"{type(self.inner).__name__} cannot be the inner level: it cannot be cut back "
                                "with the draft LM's cache (an EAGLE, EAGLE-3, DFlash or Medusa head can)")
            try:  # a head of the draft LM: it reads the draft LM's features
                self.inner.head.check_target(model)
            except ValueError as e:
                raise ValueError(f"the inner level needs a head trained on the draft LM (target=<the draft LM>): {e}") from None
        elif not isinstance(self.inner, NgramDrafter):
            raise TypeError(f"the inner level drafts with an NgramDrafter or a head's drafter, not {type(self.inner).__name__}")
        self._head = isinstance(self.inner, HeadDrafter)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[HierarchicalState]:
        """Each row's state; with a head, its own inner state (a batch of one: the rows' draft LMs read
        different texts at different times), reserved for the text plus a chain and one round of guesses."""
        inner = [self.inner.new_rows([p], [n + 2 * self.option.length + 1])[0] if self._head else None
                 for p, n in zip(prompts, lengths)]
        return [HierarchicalState(seq=p[0, :1], inner=s) for p, s in zip(prompts, inner)]

    def _cut(self, state: HierarchicalState, keep: int) -> None:
        super()._cut(state, keep)
        if self._head:
            state.feats = state.feats[:keep]
            if state.observed > max(keep - 1, 0):  # a pair needs its next token kept too
                state.observed = max(keep - 1, 0)
                self.inner.rewind_rows([state.inner], [state.observed])

    def _read(self, state: HierarchicalState, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (T,) after the cache; float32 logits (T, V): the law after each of them."""
        start = state.cache.get_seq_length()
        pos = torch.arange(start, start + tokens.numel(), device=tokens.device)[None]
        if self._head:
            out = target_forward(self.model, tokens[None], aux_layer_ids=self.inner.aux_layer_ids, position_ids=pos,
                                 past_key_values=state.cache, use_cache=True)
            feats = (out.aux_hidden if self.inner.aux_layer_ids else out.final_hidden)[0]
            state.feats = feats if state.feats is None else torch.cat([state.feats, feats])
        else:
            out = self.model(input_ids=tokens[None], position_ids=pos, use_cache=True, **cache_kwargs(self.model, state.cache))
        state.cached = tokens if state.cached is None else torch.cat([state.cached, tokens])
        return out.logits[0].float()

    def _forward(self, state: HierarchicalState, tokens: Tensor) -> Tensor:
        return self._read(state, tokens)[-1]

    def _guesses(self, state: HierarchicalState, decided: list[Tensor], pending: Tensor | None, need: int) -> Tensor:
        """Up to ``need`` guesses (G,) of the draft LM's next tokens after the ``decided`` tokens of this
        chain (root first; ``pending``, the last of them, not cached yet)."""
        if not self._head:
            text = torch.cat([state.seq, torch.stack(decided[1:])]) if len(decided) > 1 else state.seq
            found = find_continuations(text, self.inner.max_ngram, self.inner.min_ngram, min(self.inner.length, need), 1)
            return found[0] if found else text.new_zeros(0)
        text = state.cached if pending is None else torch.cat([state.cached, pending.reshape(1)])
        n = text.numel()
        if state.observed < n - 1:  # the pairs up to the last decided token
            self.inner.observe_rows([state.inner], [state.feats[state.observed: n - 1][None]],
                                    [text[state.observed + 1:][None]])
            state.observed = n - 1
        return self.inner.propose_rows([state.inner], [text[-1]], GREEDY, [need])[0].tokens[1:]

    @torch.inference_mode()
    def _propose(self, state: HierarchicalState, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        """One row's chain (``LMDrafter.propose_rows`` runs it per row): the draft LM's rounds of guesses."""
        length = min(self.option.length, max_depth)
        if length <= 0:
            return root_only(root)
        logits = self._catch_up(state)  # (V,) the draft LM's law after the root
        tokens, qs, pending = [root], [], None  # pending: the last decided token, not cached yet
        while True:  # one draft-LM forward per round: the pending token and the guesses after it
            need = length - (len(tokens) - 1)
            guesses = self._guesses(state, tokens, pending, need)  # (G,) guesses of the next G tokens
            fed = guesses[: need - 1]  # the chain's last token needs no law after it
            if pending is None:
                laws = torch.cat([logits[None], self._read(state, fed)]) if fed.numel() else logits[None]
            else:
                laws = self._read(state, torch.cat([pending.reshape(1), fed]))  # (1 + F, V): law of token i
            for i in range(laws.shape[0]):
                guess = guesses[i] if i < guesses.numel() else None
                token, q = self._decide(laws[i], guess, sampling)
                tokens.append(token)
                if q is not None:
                    qs.append(q)
                if len(tokens) - 1 == length:
                    return chain_draft(tokens, qs)
                if i == fed.numel() or bool(token != guess):  # sync: a rejected guess ends the round
                    break
            self._cut(state, state.cached.numel() - (fed.numel() - i))  # guesses i.. were not kept
            pending = token

    @staticmethod
    def _decide(logits: Tensor, guess: Tensor | None, sampling: Sampling) -> tuple[Tensor, Tensor | None]:
        """The draft LM's token from its ``logits`` (V,) given a ``guess``, and its law ``q`` (None when
        greedy). Sampling keeps the guess with probability q(guess), else draws from q without it: the
        token's law is q either way."""
        if sampling.greedy:
            return logits.argmax(), None
        q = sampling.probs(logits)
        if guess is not None:
            if torch.rand((), device=q.device) < q[guess]:  # sync
                return guess, q
            rest = q.clone()
            rest[guess] = 0
            if rest.sum() > 0:  # sync; q(guess) = 1 up to rounding: the guess is the only token
                return torch.multinomial(rest, 1)[0], q
            return guess, q
        return torch.multinomial(q, 1)[0], q
