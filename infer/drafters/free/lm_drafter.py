"""Draft-model drafter: a small causal LM sharing the target's tokenizer drafts a chain.

The draft model keeps its own KV cache of the tokens it has read. Before each proposal the cache is
cut back to the longest prefix it shares with the emitted text (the accepted drafts stay cached,
rejected ones are dropped), the missing tokens are fed, and one token is drafted per forward.
Greedy decoding drafts the argmax; sampling drafts from the draft model's own law ``q`` (HF's
temperature -> top-k -> top-p warpers on its logits) and hands ``q`` to the lossless chain rule
(``infer.accept.chain_sample_accept``: accept with min(1, p/q), else resample from max(0, p - q)).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicCache

from draftsmith.data.base.checks import probability
from draftsmith.infer.cache import crop_dynamic
from draftsmith.infer.drafters.base import Chain, Draft, Drafter, Sampling, chain_draft, root_only
from draftsmith.target.cache_keywords import cache_kwargs
from draftsmith.target.recurrent import cache_checkpoint, check_supported, is_hybrid, restore_cache


def check_same_tokenizer(draft: nn.Module, target: nn.Module) -> None:
    """Raise ValueError unless the two models agree on vocabulary size and special token ids."""
    d, t = draft.config.get_text_config(), target.config.get_text_config()
    if d.vocab_size != t.vocab_size:
        raise ValueError(f"draft model vocab_size {d.vocab_size} != target's {t.vocab_size}: "
                         "a draft model must share the target's tokenizer")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(d, name, None), getattr(t, name, None)
        if a is not None and b is not None and a != b:
            raise ValueError(f"draft model {name} {a} != target's {b}: a draft model must share the target's tokenizer")


@dataclass
class LMState:
    seq: Tensor | None = None  # (L,) every emitted token, prompt first; seq[-1] is the root
    cache: DynamicCache = field(default_factory=DynamicCache)
    cached: Tensor | None = None  # (C,) the tokens whose KV the cache holds
    # a hybrid draft model's cache as it was before this step's drafts (target.recurrent.cache_checkpoint),
    # and how many cached tokens it held then: recurrent states roll back to it, never by cropping
    checkpoint: tuple | None = None
    mark: int = 0


class LMDrafter(Drafter):
    """Draft a ``Chain`` with a causal LM (``confidence``: greedy chains stop at the first draft
    whose draft probability falls below it, as HF's ``assistant_confidence_threshold``)."""

    aux_layer_ids: tuple[int, ...] = ()
    # a standalone draft LM is checked like a target; a view of the target's own first layers (layer skip) is not:
    # the generator checked the target, and the view of a hybrid's first layers may hold no attention layer
    checks_draft_model: bool = True

    def __init__(self, model: nn.Module, target: nn.Module, tree: Chain | None = None,
                 confidence: float | None = None) -> None:
        check_same_tokenizer(model, target)
        self.option = tree or Chain(4)
        if not isinstance(self.option, Chain):
            raise TypeError(f"a draft model drafts a Chain, not {type(self.option).__name__}")
        if self.checks_draft_model:
            check_supported(model)  # a Mamba / MiniMax draft LM, or a hybrid without attention: one line (target.recurrent)
        self.model = model.eval()
        self.confidence = probability("LMDrafter confidence", confidence)
        self.max_nodes = self.option.length + 1  # the most nodes a draft has, root included
        # a hybrid draft model keeps recurrent states: its cache is transformers' hybrid one, rolled back
        # by checkpoint and replay (target.recurrent)
        self.hybrid = is_hybrid(model.config)

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[LMState]:
        # observe_rows appends the rest of the prompt and the first token
        return [LMState(seq=prompt[0, :1]) for prompt in prompts]

    def observe_rows(self, states: list[LMState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        for state, tokens in zip(states, next_tokens):
            state.seq = torch.cat([state.seq, tokens[0].to(state.seq.device)])

    def _new_cache(self) -> DynamicCache:
        """An empty cache for the draft model: transformers' own per-layer kinds for a hybrid."""
        return DynamicCache(config=self.model.config) if self.hybrid else DynamicCache()

    def _cache(self, state: LMState) -> DynamicCache:
        if self.hybrid and not state.cache.layers:  # a fresh state's plain cache: the hybrid one instead
            state.cache = self._new_cache()
        return state.cache

    def _forward(self, state: LMState, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (T,) after the cache; returns float32 logits (V,) at the last one."""
        self._cache(state)
        start = state.cache.get_seq_length()
        pos = torch.arange(start, start + tokens.numel(), device=tokens.device)[None]
        out = self.model(input_ids=tokens[None], position_ids=pos, use_cache=True, **cache_kwargs(self.model, state.cache))
        state.cached = tokens if state.cached is None else torch.cat([state.cached, tokens])
        return out.logits[0, -1].float()

    def _catch_up(self, state: LMState) -> Tensor:
        """Cut the cache to its common prefix with ``seq`` (keeping at least one token to feed),
        feed the rest; returns the logits after the root."""
        seq = state.seq
        keep = 0
        if state.cached is not None:
            n = min(state.cached.numel(), seq.numel() - 1)
            diff = (state.cached[:n] != seq[:n]).nonzero()  # sync
            keep = int(diff[0, 0]) if diff.numel() else n
            if self.hybrid:
                keep = self._roll_back(state, keep)
            else:
                self._cut(state, keep)
        logits = self._forward(state, seq[keep:])
        if self.hybrid:  # the drafts that follow are tried on top of this: remember it
            state.checkpoint, state.mark = cache_checkpoint(state.cache), state.cached.numel()
        return logits

    def _roll_back(self, state: LMState, keep: int) -> int:
        """A hybrid draft model's cache back to at most ``keep`` tokens: the checkpoint taken before this
        step's drafts when it lies within them, else empty; returns how many tokens it holds."""
        if keep >= state.cached.numel():
            return keep
        if state.checkpoint is not None and state.mark <= keep:
            restore_cache(state.cache, state.checkpoint)
            state.cached = state.cached[: state.mark]
            return state.mark
        state.cache, state.cached, state.checkpoint = self._new_cache(), None, None
        return 0

    def _cut(self, state: LMState, keep: int) -> None:
        """Keep the first ``keep`` cached tokens (drop the rest from the cache)."""
        crop_dynamic(state.cache, keep)
        state.cached = state.cached[:keep]

    def propose_rows(self, states: list[LMState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """Each row's chain from its own draft-model cache (one row per forward)."""
        return [self._propose(s, r, sampling, d) for s, r, d in zip(states, roots, max_depths)]

    @torch.inference_mode()
    def _propose(self, state: LMState, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        length = min(self.option.length, max_depth)
        if length <= 0:
            return root_only(root)
        logits = self._catch_up(state)
        tokens, qs = [root], []
        for i in range(length):
            if sampling.greedy:
                token = logits.argmax()
                if self.confidence is not None and i > 0 and float(logits.softmax(-1)[token]) < self.confidence:
                    break  # sync
            else:
                q = sampling.probs(logits)
                token = torch.multinomial(q, 1)[0]
                qs.append(q)
            tokens.append(token)
            if i + 1 < length:
                logits = self._forward(state, token.reshape(1))
        return chain_draft(tokens, qs)
