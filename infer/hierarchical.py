"""Hierarchical drafting: a draft LM whose own drafts are drafted by n-grams, lossless at both levels.

The outer level is ``LMDrafter``'s: the draft LM drafts a chain that the target verifies. Inside, the
draft LM itself decodes speculatively: prompt lookup over prompt + output + the chain so far guesses
the draft LM's next tokens, the draft LM reads all guesses in one forward, and its own rule decides
each token (greedy: its argmax; sampling: a guess ``g`` is kept with probability ``q(g)``, else the
token is drawn from ``q`` without ``g``, renormalised; either way the token's law is exactly ``q``).
So the chain is token for token the one the draft LM drafts alone (greedy) or has its law (sampling),
and ``q`` goes to the target's min(1, p/q) rule as usual; only the number of draft-LM forwards
changes. Rejected guesses are cut from the draft LM's cache.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from infer.cache import keep_accepted
from infer.drafters import Chain, Draft, Sampling, chain_draft, root_only
from infer.lm_drafter import LMDrafter, LMState
from infer.ngram import NgramDrafter, find_continuations


class HierarchicalDrafter(LMDrafter):
    """``LMDrafter(model, target, tree)`` whose draft LM decodes with ``inner`` (an ``NgramDrafter``:
    its ``max_ngram``, ``min_ngram`` and ``length`` guesses per draft-LM forward; one branch)."""

    def __init__(self, model: nn.Module, target: nn.Module, inner: NgramDrafter | None = None,
                 tree: Chain | None = None) -> None:
        super().__init__(model, target, tree)
        self.inner = inner or NgramDrafter()
        if not isinstance(self.inner, NgramDrafter):
            raise TypeError(f"the inner level drafts with an NgramDrafter, not {type(self.inner).__name__}")

    def _cut(self, state: LMState, keep: int) -> None:
        """Keep the first ``keep`` cached tokens (drop rejected guesses)."""
        keep_accepted(state.cache, keep, state.cached.new_zeros(0))
        state.cached = state.cached[:keep]

    def _read(self, state: LMState, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (T,) after the cache; float32 logits (T, V): the law after each of them."""
        start = state.cache.get_seq_length()
        pos = torch.arange(start, start + tokens.numel(), device=tokens.device)[None]
        out = self.model(input_ids=tokens[None], position_ids=pos, past_key_values=state.cache, use_cache=True)
        state.cached = torch.cat([state.cached, tokens])
        return out.logits[0].float()

    @torch.inference_mode()
    def propose(self, state: LMState, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        length = min(self.option.length, max_depth)
        if length <= 0:
            return root_only(root)
        logits = self._catch_up(state)  # (V,) the draft LM's law after the root
        tokens, qs, pending = [root], [], None  # pending: the last decided token, not cached yet
        while True:  # one draft-LM forward per round: the pending token and the guesses after it
            need = length - (len(tokens) - 1)
            text = torch.cat([state.seq, torch.stack(tokens[1:])]) if len(tokens) > 1 else state.seq
            found = find_continuations(text, self.inner.max_ngram, self.inner.min_ngram, min(self.inner.length, need), 1)
            guesses = found[0] if found else text.new_zeros(0)  # (G,) guesses of the next G tokens
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
        """The draft LM's token from its ``logits`` (V,) given an n-gram ``guess``, and its law ``q``
        (None when greedy). Sampling keeps the guess with probability q(guess), else draws from q
        without it: the token's law is q either way."""
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
