"""EAGLE-1/2's drafter: one head step per draft level over the head's own KV cache; a chain, or an
EAGLE-2 dynamic tree (expand the top_k most likely nodes per level, keep the best total_tokens).

A batch's rows share one head cache (``StaticHeadCache`` with a row each): observing accepted tokens
and drafting a chain run one head forward for every row at once (rows with fewer tokens padded, rows
not drafting carried along as dummies whose writes land past their length); so does drafting a
dynamic tree, each row's tree attending to its own prefix and explored nodes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from draftsmith.data.base.checks import probability
from draftsmith.infer.accept import categorical
from draftsmith.infer.cache import SlotWrites, StaticHeadCache, block_slot_mask, buffer_size, slot_mask
from draftsmith.infer.compiling import compiled, step_begin
from draftsmith.infer.drafters.base import (Chain, Draft, DynamicTree, HeadDrafter, Sampling, StaticTree,
                                            chain_buffers, draft_by_batch, group_rows, root_only, stack_rows)
from draftsmith.infer.drafters.shared.static_tree import StaticPlan, draft_static_trees
from draftsmith.infer.tree import Candidates, expand_level, select_trees, tree_from_parents



@dataclass
class EagleState:
    cache: StaticHeadCache = field(default_factory=StaticHeadCache)  # accepted positions only; shared by a batch
    row: int = 0  # this row's index in ``cache``
    hidden: Tensor | None = None  # (1, 1, H) head output at the last accepted position


class EagleDrafter(HeadDrafter):
    """EAGLE-1/2: one head step per draft level over the head's own KV cache, drafting through the
    target's lm_head (EAGLE-3 overrides how features enter and logits leave)."""

    def __init__(self, head: nn.Module, target: nn.Module, tree: DynamicTree | Chain,
                 confidence: float | None = None) -> None:
        self.head = head
        self.confidence = probability("confidence", confidence)  # greedy chains stop before a draft whose head probability is lower
        self.option = tree
        if not isinstance(self.option, (DynamicTree, StaticTree, Chain)):
            raise TypeError(f"EAGLE heads draft a DynamicTree, a StaticTree or a Chain, not {type(self.option).__name__}")
        self.aux_layer_ids = tuple(head.feature_layer_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        # per draft depth, what a sampled draft's logits are divided by (the head's fitted draft temperature)
        self.draft_temperature = tuple(getattr(getattr(head, "config", None), "draft_temperature", None) or ())
        if isinstance(tree, Chain):
            self.max_nodes = tree.length + 1
            self._explored = tree.length  # head-cache entries one draft writes past the prefix
        elif isinstance(tree, StaticTree):
            self._static = StaticPlan.of(tree)
            self.max_nodes = self._explored = len(tree.choices) + 1
        else:
            self.max_nodes = tree.total_tokens
            self._explored = tree.depth * tree.top_k

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[EagleState]:
        """The rows of a batch, on one head cache with a row each: every accepted position plus one
        draft's exploration."""
        cache = StaticHeadCache(buffer_size(max(lengths) + self._explored + 1), rows=len(lengths))
        return [EagleState(cache, b) for b in range(len(lengths))]

    def _logits(self, hidden: Tensor) -> Tensor:
        """Draft logits (..., V) in float32 from head outputs (..., H)."""
        return self.lm_head(hidden).float()

    def _sampled_law(self, logits: Tensor, sampling: Sampling, depth: int) -> Tensor:
        """The law a sampled draft at ``depth`` (0 = the first) is drawn from: the head's ``logits`` over its
        fitted draft temperature there (the last one past its depths; none: 1), then ``sampling``'s temperature,
        top-k and top-p (docs/objectives.md, "One recipe for both temperatures")."""
        if self.draft_temperature:
            logits = logits / self.draft_temperature[min(depth, len(self.draft_temperature) - 1)]
        return sampling.probs(logits)

    def _to_target(self, ids: Tensor) -> Tensor:
        """Target ids of draft-vocab ids (the same vocab here)."""
        return ids

    def _law_over_target(self, q: Tensor) -> Tensor:
        """A draft law (rows, V or Vd) over target ids (rows, V): the law itself where the head drafts the target's
        vocabulary, else scattered to the target ids of the draft ids (0 elsewhere)."""
        if q.shape[1] == self.vocab_size and not getattr(getattr(self.head, "config", None), "reduced_vocab", False):
            return q
        ids = self._to_target(torch.arange(q.shape[1], device=q.device))
        return q.new_zeros(q.shape[0], self.vocab_size).index_copy_(1, ids, q)

    def _project(self, features: Tensor) -> Tensor:
        """The head's input from the target's features of accepted tokens."""
        return features

    def _step(self, cache, hidden: Tensor, tokens: Tensor, position: Tensor, mask: Tensor | None) -> Tensor:
        """Head forward (R, T, H) -> (R, T, H), appending T entries per row to ``cache`` (a
        ``StaticHeadCache`` for every row, or one row's view)."""
        out = self.head(
            hidden_states=hidden,
            inputs_embeds=self.embed(tokens),
            position_ids=position,
            attention_mask=mask,
            past_key_values=cache,
        )
        return out.hidden_states

    def _batched_step(self, cache: StaticHeadCache, hidden: Tensor, tokens: Tensor,
                      counts: list[int] | None = None) -> Tensor:
        """One head forward for every row of ``cache``: hidden (rows, T, H), tokens (rows, T) after each
        row's entries (row b keeps ``counts[b]`` of them; None = all T)."""
        t, row_lengths = tokens.shape[1], cache.row_lengths()
        lengths = torch.tensor(row_lengths, device=tokens.device)
        position = lengths[:, None] + torch.arange(t, device=tokens.device)[None]  # (rows, T)
        # one new entry per row, every row at one length: each query sees every entry the cache returns (no mask)
        uniform = t == 1 and min(row_lengths) == max(row_lengths)
        mask = None if uniform else cache.causal_mask(t, hidden.dtype, tokens.device)
        cache.counts = counts
        try:
            return self._step(cache, hidden, tokens, position, mask)
        finally:
            cache.counts = None

    def observe_rows(self, states: list[EagleState], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        """One head forward per batch over every row's accepted tokens (padded to the longest)."""
        for group in group_rows(states).values():
            cache = states[group[0]].cache
            index = [states[i].row for i in group]
            feats, counts = stack_rows(cache.rows, index, [features[i] for i in group])  # (rows, A, F)
            tokens, _ = stack_rows(cache.rows, index, [next_tokens[i] for i in group])  # (rows, A)
            out = self._batched_step(cache, self._project(feats), tokens, counts)  # (rows, A, H)
            for i in group:
                b = states[i].row
                states[i].hidden = out[b: b + 1, counts[b] - 1: counts[b]]

    def rewind_rows(self, states: list[EagleState], lengths: list[int]) -> None:
        """Each row's head cache keeps its first ``lengths[i]`` entries (``hidden`` is set again by the
        next observe)."""
        for state, length in zip(states, lengths):
            state.cache.crop_row(state.row, length)

    def propose_rows(self, states: list[EagleState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """One head forward per draft level for every row of a batch (a chain or a dynamic tree)."""
        if isinstance(self.option, DynamicTree):
            return draft_by_batch(states, roots, max_depths, self.option.depth, self._trees)
        if isinstance(self.option, StaticTree):  # eager, whatever the compile switch
            return draft_by_batch(states, roots, max_depths, max(self._static.depths), lambda cache, rows, tips, n:
                                  draft_static_trees(self, cache, rows, tips, n, sampling, self._static,
                                                     self.option.sampled))
        return draft_by_batch(states, roots, max_depths, self.option.length,
                              lambda cache, rows, tips, lengths: self._chains(cache, rows, tips, lengths, sampling))

    def _chains(self, cache: StaticHeadCache, states: list[EagleState], roots: list[Tensor], lengths: list[int],
                sampling: Sampling) -> list[Draft]:
        """A chain of ``lengths[i]`` drafts for each of ``states`` (rows of ``cache``)."""
        levels = max(lengths)
        if levels <= 0:
            return [root_only(r) for r in roots]
        rows = [s.row for s in states]
        hidden, _ = stack_rows(cache.rows, rows, [s.hidden for s in states])  # (rows, 1, H)
        prefix = cache.row_lengths()
        tokens, qs, confident = [], [], []
        if self._fixed_chain is not None and sampling.greedy and self.confidence is None:
            cache.make_room(max(prefix) + self.option.length)
            start = torch.tensor(prefix, device=hidden.device)
            step_begin(hidden.device)
            # every step the whole chain (one graph), each row then keeping its own length
            tokens = list(self._fixed_chain(cache, hidden, start, self.option.length).unbind(1))
            levels = 0  # drafted
        try:
            for i in range(levels):  # eager
                logits = self._logits(hidden[:, -1])  # (rows, V or Vd)
                if sampling.greedy:
                    draft_ids = logits.argmax(dim=-1)
                    if self.confidence is not None:
                        confident.append(logits.softmax(-1).max(-1).values >= self.confidence)
                else:
                    q = self._sampled_law(logits, sampling, i)
                    draft_ids = categorical(q)
                    qs.append(self._law_over_target(q))
                tokens.append(self._to_target(draft_ids))
                if i + 1 < levels:  # each row's chain is contiguous after its prefix: causal attention
                    hidden = self._batched_step(cache, hidden, tokens[-1][:, None])
        finally:
            cache.crop_rows(prefix)  # exploration KV is approximate: keep accepted tokens only
        chain = torch.stack(tokens, dim=1)  # (rows, L)
        if confident:  # greedy chains stop before the first draft (after the first) the head is unsure of
            sure = torch.stack(confident, dim=1)
            sure[:, 0] = True
            kept = sure.int().cumprod(dim=1).sum(dim=1).tolist()  # sync: one per step, for every row
            lengths = [min(n, k) for n, k in zip(lengths, kept)]
        law = torch.stack(qs, dim=1) if qs else None  # (rows, L, V)
        drafts = []
        for state, root, n in zip(states, roots, lengths):
            b = state.row
            ids = torch.cat([root.reshape(1), chain[b, :n]])
            drafts.append(Draft(ids, chain_buffers(n, ids.device), None if law is None else law[b, :n]))
        return drafts

    def compile_with(self, compile: bool | str) -> None:
        """Compiled: greedy chains (no confidence stop) draft through ``_fixed_levels`` and dynamic trees
        through ``_tree_levels`` in its fixed-shape form, each compiled once per (rows, depth, cache
        capacity)."""
        device = self.embed.weight.device
        self._fixed_chain = compiled(self._fixed_levels, compile, device, self.head) if compile else None
        self._fixed_tree = compiled(self._tree_levels, compile, device, self.head) if compile else None

    _fixed_chain = _fixed_tree = None  # set by compile_with

    def _fixed_levels(self, cache: StaticHeadCache, hidden: Tensor, start: Tensor, levels: int) -> Tensor:
        """A greedy chain of ``levels`` target ids per row (rows, levels), every head step over the whole
        cache (``SlotWrites``: row b's level-i entry at slot start[b] + i, keys past it masked): the same
        shapes whatever the rows' lengths, and no host read. Each row's writes are exploration (the
        cache's lengths stay at ``start``)."""
        out = []
        for i in range(levels):
            ids = self._to_target(self._logits(hidden[:, -1]).argmax(dim=-1))  # (rows,)
            out.append(ids)
            if i + 1 < levels:
                slots = (start + i)[:, None]  # (rows, 1)
                mask = slot_mask(slots, cache.capacity, hidden.dtype)
                hidden = self._step(SlotWrites(cache, slots), hidden, ids[:, None], slots, mask)
        return torch.stack(out, dim=1)

    def _trees(self, cache: StaticHeadCache, states: list[EagleState], roots: list[Tensor],
               levels: list[int]) -> list[Draft]:
        """An EAGLE-2 dynamic tree of ``levels[i]`` levels for each of ``states`` (rows of ``cache``):
        one head forward per level for every row (each row's frontier is top_k wide at every level;
        rows not drafting carried along as dummies), every row drafted to the deepest and its deeper
        levels dropped before its selection (what that row drafts alone)."""
        depth = max(levels)
        if depth <= 0:
            return [root_only(r) for r in roots]
        prefix = cache.row_lengths()
        hidden, _ = stack_rows(cache.rows, [s.row for s in states], [s.hidden for s in states])  # (rows, 1, H)
        starts = torch.tensor(prefix, device=hidden.device)  # (rows,)
        if self._fixed_tree is not None:  # compiled: the whole tree depth every step, over the whole cache
            cache.make_room(max(prefix) + self._explored)
            step_begin(hidden.device)
            candidates, sizes = self._fixed_tree(cache, hidden, starts, self.option.depth, None)
        else:
            try:
                candidates, sizes = self._tree_levels(cache, hidden, starts, depth, prefix)
            finally:
                cache.crop_rows(prefix)  # exploration KV is approximate: keep accepted tokens only
        rows = [s.row for s in states]
        per_row = Candidates(candidates.tokens[rows], candidates.scores[rows], candidates.parents[rows])
        chosen, parent_lists = select_trees(per_row, self.option.total_tokens - 1,
                                            [sum(sizes[:n]) for n in levels])
        drafts = []
        for i, (root, n) in enumerate(zip(roots, levels)):
            if n <= 0:
                drafts.append(root_only(root))
                continue
            ids = torch.cat([root.reshape(1), per_row.tokens[i, chosen[i]]])
            drafts.append(Draft(ids, tree_from_parents(parent_lists[i], root.device)))
        return drafts

    def _tree_levels(self, cache: StaticHeadCache, hidden: Tensor, starts: Tensor, levels: int,
                     prefix: list[int] | None) -> tuple[Candidates, list[int]]:
        """Every row's candidates (rows, M) over ``levels`` levels (children of the root have parent
        -1), and how many candidates each level adds; hidden (rows, 1, H) the rows' head outputs at
        their last accepted token, starts (rows,) their cache lengths. Eager (``prefix`` the same
        lengths as host ints): each level appends to the cache (the caller crops it back). Fixed shape
        (``prefix`` None: compiled): level entries written at device slots (``SlotWrites``) and every
        mask over the whole capacity (``block_slot_mask``); the cache's lengths stay as they were."""
        top_k = self.option.top_k
        device = hidden.device
        logp = self._logits(hidden).log_softmax(dim=-1)  # (rows, 1, Vd)
        tok, scores, _, frontier = expand_level(logp.new_zeros(cache.rows, 1), logp, top_k)
        tokens, all_scores = [self._to_target(tok)], [scores]  # per level (rows, n)
        parents = [torch.full_like(tok, -1)]
        offset = 0  # candidate index of the current level's first child
        width = frontier.shape[1]
        parent_hidden = hidden.expand(-1, width, -1)  # (rows, F, H) parents' outputs
        ancestors = torch.zeros(cache.rows, width, 0, dtype=torch.bool, device=device)  # (rows, F, E)
        eye = torch.eye(width, dtype=torch.bool, device=device)
        for level in range(1, levels):
            allowed = torch.cat([ancestors, eye.expand(cache.rows, -1, -1)], dim=2)  # (rows, F, E + F)
            pos = (starts + level - 1)[:, None].expand(-1, width)  # (rows, F)
            if prefix is None:  # fixed shape: this level's F entries after the E explored ones
                explored = ancestors.shape[2]
                writes = SlotWrites(cache, starts[:, None] + explored + torch.arange(width, device=device)[None])
                mask = block_slot_mask(starts, allowed, cache.capacity, parent_hidden.dtype)
            else:
                writes, mask = cache, cache.block_mask(prefix, allowed, parent_hidden.dtype)
            out = self._step(writes, parent_hidden, tokens[-1].gather(1, frontier), pos, mask)  # (rows, F, H)
            logp = self._logits(out).log_softmax(dim=-1)  # (rows, F, Vd)
            tok, child_scores, slots, next_frontier = expand_level(scores.gather(1, frontier), logp, top_k)
            parents.append(offset + frontier.gather(1, slots))
            offset += tokens[-1].shape[1]
            tokens.append(self._to_target(tok))
            all_scores.append(child_scores)
            scores = child_scores
            keep = slots.gather(1, next_frontier)  # (rows, F') which frontier node each new one hangs off
            parent_hidden = out.gather(1, keep[..., None].expand(-1, -1, out.shape[-1]))
            ancestors = torch.cat([ancestors.gather(1, keep[..., None].expand(-1, -1, ancestors.shape[-1])),
                                   eye[keep]], dim=2)
            frontier = next_frontier
        sizes = [t.shape[1] for t in tokens]
        return Candidates(torch.cat(tokens, dim=1), torch.cat(all_scores, dim=1), torch.cat(parents, dim=1)), sizes

    shapes = (DynamicTree, StaticTree, Chain)
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
        """On CPU a chain of 4 (where the default adapts its length, it starts there): each draft level
        is a head forward plus the tree's bookkeeping and each verified token costs, and on the demo
        target (docs/benchmarks.md) chains of 3 to 6 beat every dynamic tree tried (8 to 16 nodes)."""
        return Chain(4) if torch.device(device).type == "cpu" else cls.branching_tree(device)

    @classmethod
    def adapts_by_default(cls, device: torch.device) -> bool:
        """On CPU: a chain of adaptive length beat every fixed chain on the demo target, 2.51x against the
        best fixed chain's 1.96x (EAGLE), 2.38-2.47x against 1.84-2.09x (self-distilled EAGLE-3;
        docs/benchmarks.md)."""
        return torch.device(device).type == "cpu"


DRAFTER = EagleDrafter
