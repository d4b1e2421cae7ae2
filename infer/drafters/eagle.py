"""EAGLE-1/2's drafter: one head step per draft level over the head's own KV cache; a chain, or an
EAGLE-2 dynamic tree (expand the top_k most likely nodes per level, keep the best total_tokens)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from data.base.checks import probability
from heads.layers import HeadCache
from infer.cache import StaticHeadCache
from infer.drafters.base import Chain, Draft, DynamicTree, HeadDrafter, Sampling, chain_draft, root_only
from infer.tree import Candidates, expand_level, select_tree, tree_attention_mask, tree_from_parents



@dataclass
class EagleState:
    cache: HeadCache | StaticHeadCache = field(default_factory=HeadCache)  # accepted positions only
    hidden: Tensor | None = None  # (1, 1, H) head output at the last accepted position


class EagleDrafter(HeadDrafter):
    """EAGLE-1/2: one head step per draft level over the head's own KV cache, drafting through the
    target's lm_head (EAGLE-3 overrides how features enter and logits leave)."""

    def __init__(self, head: nn.Module, target: nn.Module, tree: DynamicTree | Chain,
                 confidence: float | None = None) -> None:
        self.head = head
        self.confidence = probability("confidence", confidence)  # greedy chains stop before a draft whose head probability is lower
        self.option = tree
        if not isinstance(self.option, (DynamicTree, Chain)):
            raise TypeError(f"EAGLE heads draft a DynamicTree or a Chain, not {type(self.option).__name__}")
        self.aux_layer_ids = tuple(head.feature_layer_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        if isinstance(tree, Chain):
            self.max_nodes = tree.length + 1
            self._explored = tree.length  # head-cache entries one draft writes past the prefix
        else:
            self.max_nodes = tree.total_tokens
            self._explored = tree.depth * tree.top_k

    def new_state(self) -> EagleState:
        return EagleState()

    def reserve(self, state: EagleState, length: int) -> None:
        """Preallocate the head's cache: every accepted position plus one draft's exploration."""
        state.cache = StaticHeadCache(length + self._explored + 1)

    def _logits(self, hidden: Tensor) -> Tensor:
        """Draft logits (..., V) in float32 from head outputs (..., H)."""
        return self.lm_head(hidden).float()

    def _to_target(self, ids: Tensor) -> Tensor:
        """Target ids of draft-vocab ids (the same vocab here)."""
        return ids

    def _project(self, features: Tensor) -> Tensor:
        """The head's input from the target's features of accepted tokens."""
        return features

    def _step(self, state: EagleState, hidden: Tensor, tokens: Tensor, position: Tensor, mask: Tensor | None) -> Tensor:
        """Head forward (1, T, H) -> (1, T, H), appending T entries to the head cache."""
        out = self.head(
            hidden_states=hidden,
            inputs_embeds=self.embed(tokens),
            position_ids=position,
            attention_mask=mask,
            past_key_values=state.cache,
        )
        return out.hidden_states

    def observe(self, state: EagleState, features: Tensor, next_tokens: Tensor) -> None:
        start = state.cache.get_seq_length()
        hidden = self._project(features)  # (1, A, H)
        position = torch.arange(start, start + next_tokens.shape[1], device=next_tokens.device)[None]
        state.hidden = self._step(state, hidden, next_tokens, position, None)[:, -1:]

    def propose(self, state: EagleState, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        prefix = state.cache.get_seq_length()
        try:
            if isinstance(self.option, Chain):
                return self._chain(state, root, min(self.option.length, max_depth), sampling, prefix)
            return self._tree(state, root, min(self.option.depth, max_depth), prefix)
        finally:
            state.cache.crop(prefix)  # exploration KV is approximate: keep accepted tokens only

    def _chain(self, state: EagleState, root: Tensor, length: int, sampling: Sampling, prefix: int) -> Draft:
        hidden, tokens, qs = state.hidden, [root], []
        for i in range(length):
            logits = self._logits(hidden[0, -1])  # (V or Vd,)
            if sampling.greedy:
                if self.confidence is not None and i > 0 and float(logits.softmax(-1).max()) < self.confidence:
                    break  # sync: the head is unsure, verify what it has
                token = self._to_target(logits.argmax())
            else:
                q = sampling.probs(logits)
                draft_id = torch.multinomial(q, 1)[0]
                token = self._to_target(draft_id)
                q_full = q.new_zeros(self.vocab_size)  # (V,): the draft law over target ids
                q_full[self._to_target(torch.arange(q.shape[0], device=q.device))] = q
                qs.append(q_full)
            tokens.append(token)
            if i + 1 < length:  # the chain is contiguous after the prefix: plain causal attention
                pos = torch.full((1, 1), prefix + i, device=root.device)
                hidden = self._step(state, hidden, token.reshape(1, 1), pos, None)
        return chain_draft(tokens, qs)

    def _tree(self, state: EagleState, root: Tensor, levels: int, prefix: int) -> Draft:
        if levels == 0:
            return root_only(root)
        opt = self.option
        device = root.device
        logp = self._logits(state.hidden[0]).log_softmax(dim=-1)  # (1, Vd)
        tok, scores, _, frontier = expand_level(logp.new_zeros(1), logp, opt.top_k)
        tokens, all_scores = [self._to_target(tok)], [scores]
        parents = [torch.full_like(tok, -1)]
        offset = 0  # candidate index of the current level's first child
        parent_hidden = state.hidden.expand(1, frontier.numel(), -1)  # (1, F, H) parents' outputs
        ancestors = torch.zeros(frontier.numel(), 0, dtype=torch.bool, device=device)  # (F, E)
        for level in range(1, levels):
            width = frontier.numel()
            allowed = torch.cat(
                [ancestors, torch.eye(width, dtype=torch.bool, device=device)], dim=1
            )  # (F, E + F): explored ancestors, then self
            mask = tree_attention_mask(allowed, prefix, parent_hidden.dtype)  # (1, 1, F, S + E + F)
            pos = torch.full((1, width), prefix + level - 1, device=device)
            out = self._step(state, parent_hidden, tokens[-1][frontier][None], pos, mask)  # (1, F, H)
            logp = self._logits(out[0]).log_softmax(dim=-1)  # (F, Vd)
            tok, child_scores, slots, next_frontier = expand_level(scores[frontier], logp, opt.top_k)
            parents.append(offset + frontier[slots])
            offset += tokens[-1].numel()
            tokens.append(self._to_target(tok))
            all_scores.append(child_scores)
            scores = child_scores
            keep = slots[next_frontier]  # (F',) which frontier node each new frontier node hangs off
            parent_hidden = out[:, keep]
            ancestors = torch.cat([ancestors[keep], torch.eye(width, dtype=torch.bool, device=device)[keep]], dim=1)
            frontier = next_frontier
        candidates = Candidates(torch.cat(tokens), torch.cat(all_scores), torch.cat(parents))
        chosen, parent_list = select_tree(candidates, opt.total_tokens - 1)
        return Draft(torch.cat([root.reshape(1), candidates.tokens[chosen]]), tree_from_parents(parent_list, device))

    shapes = (DynamicTree, Chain)
    # EAGLE-2's reference depth (EAGLE-3: 8), top_k 10 and 60 verified tokens on accelerators
    gpu_depth = 6

    @classmethod
    def branching_tree(cls, device: torch.device) -> DynamicTree:
        """Accelerators: the reference dynamic tree, where verifying 60 tokens costs about as much as
        one. On CPU: the dynamic tree that measured fastest on the demo target (depth 5, top_k 2, 8 nodes)."""
        if torch.device(device).type == "cpu":
            return DynamicTree(depth=5, top_k=2, total_tokens=8)
        return DynamicTree(depth=cls.gpu_depth)

    @classmethod
    def default_tree(cls, device: torch.device) -> Chain | DynamicTree:
        """On CPU a chain of 4: there each draft level is a head forward plus the tree's bookkeeping and
        each verified token costs, and on the demo target (docs/benchmarks.md) chains of 3 to 6 beat
        every dynamic tree tried (8 to 16 nodes) with 400-step EAGLE and EAGLE-3 heads."""
        return Chain(4) if torch.device(device).type == "cpu" else cls.branching_tree(device)


DRAFTER = EagleDrafter
