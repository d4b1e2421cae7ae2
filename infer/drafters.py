"""Per-kind drafting: turn a head's state into a draft tree rooted at the last emitted token.

A drafter follows the ``Drafter`` protocol. The generator calls ``observe`` with the target's
features of newly accepted tokens (true features, from the verify forward) and ``propose`` to get
the next draft. Per-generation state lives in a small dataclass that the generator holds and
passes back explicitly; drafters themselves are stateless.

Position convention (one token shift, as in EAGLE): ``features[:, i]`` is the target's feature at
the token t_i and ``next_tokens[:, i]`` is t_{i+1}; the last pair's next token is the current root.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from heads.layers import HeadCache
from infer.accept import sampling_probs
from infer.cache import StaticHeadCache
from infer.tree import (
    MEDUSA_DEFAULT_CHOICES,
    Candidates,
    TreeBuffers,
    chain_parents,
    expand_level,
    medusa_tree,
    select_tree,
    tree_attention_mask,
    tree_from_parents,
)


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters (HF semantics); temperature 0 = greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class StaticTree:
    """Medusa static tree from choices (paths of per-head ranks)."""

    choices: tuple[tuple[int, ...], ...] = MEDUSA_DEFAULT_CHOICES


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree: ``depth`` draft levels, ``top_k`` children per expanded node, and
    ``total_tokens`` nodes verified per step including the root."""

    depth: int = 6
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise ValueError(f"DynamicTree needs depth >= 1, top_k >= 1, total_tokens >= 2; got {self}")


@dataclass(frozen=True)
class Chain:
    """A plain chain of ``length`` drafts (greedy drafts, or sampled ones when temperature > 0)."""

    length: int = 4

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"Chain length must be >= 1, got {self.length}")


TreeOption = StaticTree | DynamicTree | Chain


def default_branching_tree(kind: str, device: torch.device | str) -> StaticTree | DynamicTree:
    """The kind's tree-shaped default: Medusa's static tree, an EAGLE-2 dynamic tree.

    Accelerators: the reference settings (Medusa's mc_sim_7b_63; EAGLE-2 depth 6 and EAGLE-3 depth
    8, top_k 10, 60 verified tokens), where verifying 60 tokens costs about as much as one. On CPU
    every verified token costs (t(8)/t(1) = 1.3, t(32)/t(1) = 1.9 on the demo target), so trees
    are small: Medusa verifies the first 15 nodes of mc_sim_7b_63, EAGLE heads the dynamic tree that
    measured fastest on the demo target (depth 5, top_k 2, 8 nodes).
    """
    if torch.device(device).type == "cpu":
        trees = {"medusa": StaticTree(MEDUSA_DEFAULT_CHOICES[:15]),  # every prefix of the list is a tree
                 "eagle": DynamicTree(depth=5, top_k=2, total_tokens=8),
                 "eagle3": DynamicTree(depth=5, top_k=2, total_tokens=8)}
    else:
        trees = {"medusa": StaticTree(), "eagle": DynamicTree(depth=6), "eagle3": DynamicTree(depth=8)}
    if kind not in trees:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(trees)}")
    return trees[kind]


def default_tree(kind: str, device: torch.device | str) -> TreeOption:
    """What a generator drafts when given no tree: ``default_branching_tree``, except EAGLE heads
    on CPU, which draft a chain of 4. There each draft level is a head forward plus the tree's
    bookkeeping and each verified token costs, and on the demo target (docs/benchmarks.md) chains
    of 3 to 6 beat every dynamic tree tried (8 to 16 nodes) with 400-step EAGLE and EAGLE-3 heads.
    """
    tree = default_branching_tree(kind, device)
    if torch.device(device).type == "cpu" and kind in ("eagle", "eagle3"):
        return Chain(4)
    return tree


@dataclass
class Draft:
    """One draft, ready for verification."""

    tokens: Tensor  # (N,) target ids; tokens[0] = root
    tree: TreeBuffers
    q: Tensor | None = None  # (N-1, V) law each chain draft was sampled from; None = deterministic


class Drafter:
    """What the generator needs from a drafter: every drafter (heads, the draft LM, n-grams, the
    adaptive wrapper, test stubs) subclasses this. ``new_state``, ``observe`` and ``propose`` are
    its own; ``reserve`` and ``begin`` are hooks that do nothing unless a drafter needs them."""

    aux_layer_ids: tuple[int, ...] = ()  # target features read: () = the final post-norm hidden
    # The most nodes (root included) a draft can have: the tree budget the static cache is sized for
    # and a compiled verify pads every draft to (required there; None: eager only, the cache grows).
    max_nodes: int | None = None

    def new_state(self) -> Any:
        """Per-generation state, passed back to every other call."""
        raise NotImplementedError

    def observe(self, state: Any, features: Tensor, next_tokens: Tensor) -> None:
        """features (1, A, F) of accepted tokens, next_tokens (1, A) the token after each."""
        raise NotImplementedError

    def propose(self, state: Any, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        """A draft rooted at ``root`` (0-d long) with at most ``max_depth`` draft levels."""
        raise NotImplementedError

    def reserve(self, state: Any, length: int) -> None:
        """Preallocate per-generation buffers for ``length`` tokens (prompt + max_new_tokens);
        called after ``new_state``."""

    def begin(self, state: Any, input_ids: Tensor) -> None:
        """See the prompt's ids (1, P) before the first ``observe`` (drafters that read token ids)."""


@functools.lru_cache(maxsize=64)
def chain_buffers(num_drafts: int, device: torch.device) -> TreeBuffers:
    """Buffers of a chain of ``num_drafts`` (built once per length and device: they never change,
    and no consumer writes into them)."""
    return tree_from_parents(chain_parents(num_drafts), device)


def root_only(root: Tensor) -> Draft:
    return Draft(tokens=root.reshape(1), tree=chain_buffers(0, root.device))


def _chain_draft(tokens: list[Tensor], q: list[Tensor]) -> Draft:
    ids = torch.stack(tokens)  # (N,)
    return Draft(ids, chain_buffers(len(tokens) - 1, ids.device), torch.stack(q) if q else None)


# ----------------------------------------------------------------------------------- Medusa


@dataclass
class MedusaState:
    logits: Tensor | None = None  # (K, V) float32 head logits at the last accepted token


class MedusaDrafter(Drafter):
    """Medusa heads on the final hidden state of the last accepted token; static tree or chain."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, head: nn.Module, tree: StaticTree | Chain) -> None:
        self.head = head
        self.option = tree
        num_heads = head.config.num_heads
        if isinstance(self.option, Chain):
            if self.option.length > num_heads:
                raise ValueError(f"Chain(length={self.option.length}) needs that many Medusa heads; this head has {num_heads}")
            self.tree = None
            self.max_nodes = self.option.length + 1
        elif isinstance(self.option, StaticTree):
            # Paths deeper than the head count cannot be drafted: drop them (keeps prefixes closed).
            choices = [c for c in self.option.choices if len(c) <= num_heads]
            self.tree = medusa_tree(choices)
            self.max_nodes = len(choices) + 1
        else:
            raise TypeError(f"Medusa heads draft a StaticTree or a Chain, not {type(self.option).__name__}")
        # (max_depth, device) -> (buffers, ranks (N,), depth, top ranks needed): built once, no syncs later
        self._pruned: dict[tuple[int, str], tuple[TreeBuffers, Tensor, int, int]] = {}

    def new_state(self) -> MedusaState:
        return MedusaState()

    def observe(self, state: MedusaState, features: Tensor, next_tokens: Tensor) -> None:
        state.logits = self.head(features[:, -1:])[:, 0, 0].float()  # (K, V)

    def _tree_up_to(self, max_depth: int, device: torch.device) -> tuple[TreeBuffers, Tensor, int, int]:
        key = (max_depth, str(device))
        if key not in self._pruned:
            depths = self.tree.buffers.depths  # on CPU
            keep = int((depths <= max_depth).sum())  # nodes are in depth order: a prefix
            buffers = tree_from_parents(self.tree.buffers.parents[:keep], device)
            ranks = self.tree.ranks[:keep]
            self._pruned[key] = (buffers, ranks.to(device), int(depths[keep - 1]), int(ranks.max()) + 1)
        return self._pruned[key]

    def propose(self, state: MedusaState, root: Tensor, sampling: Sampling, max_depth: int) -> Draft:
        logits = state.logits  # (K, V)
        if isinstance(self.option, Chain):
            length = min(self.option.length, max_depth)
            if sampling.greedy:
                return _chain_draft([root, *logits[:length].argmax(dim=-1)], [])
            q = sampling.probs(logits[:length])  # (L, V)
            return _chain_draft([root, *torch.multinomial(q, 1)[:, 0]], list(q))
        buffers, ranks, depth, width = self._tree_up_to(min(max_depth, self.tree.depth), root.device)
        if depth == 0:
            return root_only(root)
        top = logits[:depth].topk(width, dim=-1).indices  # (D, R) each head's ranked tokens
        drafts = top[buffers.depths[1:] - 1, ranks[1:]]  # (N-1,)
        return Draft(torch.cat([root.reshape(1), drafts]), buffers)


# ------------------------------------------------------------------------------------ EAGLE


@dataclass
class EagleState:
    cache: HeadCache | StaticHeadCache = field(default_factory=HeadCache)  # accepted positions only
    hidden: Tensor | None = None  # (1, 1, H) head output at the last accepted position


class EagleDrafter(Drafter):
    """EAGLE-1/2 and EAGLE-3: one head step per draft level over the head's own KV cache."""

    def __init__(self, head: nn.Module, target: nn.Module, tree: DynamicTree | Chain,
                 confidence: float | None = None) -> None:
        self.head = head
        self.confidence = confidence  # greedy chains stop before a draft whose head probability is lower
        self.eagle3 = head.head_kind == "eagle3"
        self.option = tree
        if not isinstance(self.option, (DynamicTree, Chain)):
            raise TypeError(f"EAGLE heads draft a DynamicTree or a Chain, not {type(self.option).__name__}")
        self.aux_layer_ids = tuple(head.feature_layer_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = None if self.eagle3 else target.get_output_embeddings()
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
        """Draft logits (..., V or Vd) in float32 from head outputs (..., H)."""
        return (self.head.compute_logits(hidden) if self.eagle3 else self.lm_head(hidden)).float()

    def _to_target(self, ids: Tensor) -> Tensor:
        return self.head.draft_to_target(ids) if self.eagle3 else ids

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
        hidden = self.head.project(features) if self.eagle3 else features  # (1, A, H)
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
        return _chain_draft(tokens, qs)

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


def make_drafter(head: nn.Module, target: nn.Module, tree: TreeOption | None = None,
                 confidence: float | None = None) -> Drafter:
    """The drafter for a head's kind; ``tree=None`` = the kind's default on the target's device;
    ``confidence``: EAGLE greedy chains stop a level early below this head probability."""
    kind = getattr(head, "head_kind", None)
    tree = tree or default_tree(kind, target.get_input_embeddings().weight.device)
    if kind == "medusa":
        return MedusaDrafter(head, tree)
    return EagleDrafter(head, target, tree, confidence)
