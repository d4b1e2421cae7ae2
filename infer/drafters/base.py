"""What every drafter is: the ``Drafter`` base class, the draft it returns, the draft shapes
(``StaticTree``, ``DynamicTree``, ``Chain``) and ``HeadDrafter``, the base of a head kind's drafter.

A drafter subclasses ``Drafter``. The generator calls ``new_rows`` once per batch, then
``observe_rows`` with the target's features of newly accepted tokens (true features, from the verify
forward) and ``propose_rows`` to get the next drafts, one per row. Per-generation state lives in a small
dataclass per row that the generator holds and passes back explicitly; drafters themselves are stateless.

Position convention (one token shift, as in EAGLE): ``features[:, i]`` is the target's feature at
the token t_i and ``next_tokens[:, i]`` is t_{i+1}; the last pair's next token is the current root.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.data.base.checks import count
from draftsmith.infer.accept import sampling_probs
from draftsmith.infer.tree import MEDUSA_DEFAULT_CHOICES, TreeBuffers, chain_parents, medusa_tree, tree_from_parents


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
    """A static tree from choices (paths of ranks: Medusa's per-head ranks; an EAGLE head's node (r1, r2) is the
    rank-r2 child of its rank-r1 child). ``sampled`` (EAGLE heads): at temperature > 0 a node's rank-r child is
    the r-th draw without replacement from its draft law instead of its r-th most likely token
    (``infer.drafters.shared.static_tree``), what ``acceptance="traversal"`` verifies best (docs/traversal.md)."""

    choices: tuple[tuple[int, ...], ...] = MEDUSA_DEFAULT_CHOICES
    sampled: bool = False

    def __post_init__(self) -> None:
        """Refused here, not when a generator builds it: no path, an empty or negative one, a duplicate,
        a path without its parent (``medusa_tree``'s checks)."""
        try:
            choices = tuple(tuple(path) for path in self.choices)
        except TypeError:
            raise ValueError(f"StaticTree choices must be paths of ranks, e.g. ((0,), (1,), (0, 0)); got {self.choices!r}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for path in choices for r in path):
            raise ValueError(f"StaticTree choices must hold whole-number ranks, got {self.choices!r}")
        medusa_tree(choices)
        object.__setattr__(self, "choices", choices)
        if not isinstance(self.sampled, bool):
            raise ValueError(f"StaticTree sampled must be True or False, got {self.sampled!r}")


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic tree: ``depth`` draft levels, ``top_k`` children per expanded node, and
    ``total_tokens`` nodes verified per step including the root."""

    depth: int = 6
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self) -> None:
        count("DynamicTree depth", self.depth)
        count("DynamicTree top_k", self.top_k)
        count("DynamicTree total_tokens", self.total_tokens, least=2)


@dataclass(frozen=True)
class Chain:
    """A plain chain of ``length`` drafts (greedy drafts, or sampled ones when temperature > 0)."""

    length: int = 4

    def __post_init__(self) -> None:
        count("Chain length", self.length)


TreeOption = StaticTree | DynamicTree | Chain


@dataclass
class Draft:
    """One draft, ready for verification."""

    tokens: Tensor  # (N,) target ids; tokens[0] = root
    tree: TreeBuffers
    # (N-1, V) the draft law node i (row i-1) was drawn from, without replacement after its earlier siblings: its
    # parent's law (siblings share it; a chain: each draft's own law); None = deterministic drafts
    q: Tensor | None = None
    # (N, H) the residual stream entering the drafter's ``entry_model`` at each node, whose KV below it
    # the draft already wrote into the target's cache (layer skip); None = the verify runs every layer
    entry: Tensor | None = None


class Drafter:
    """What the generator needs from a drafter: every drafter (heads, the draft LM, n-grams, the
    adaptive wrapper, test stubs) subclasses this. Its verbs take a batch's rows, one list entry per
    row (one row: lists of one): ``new_rows``, ``observe_rows`` and ``propose_rows`` are its own;
    ``before_draft`` and ``compile_with`` are hooks that do nothing unless a drafter needs them. A
    drafter that drafts each row on its own loops over them itself (a private per-row helper)."""

    aux_layer_ids: tuple[int, ...] = ()  # target features read: () = the final post-norm hidden
    # The most nodes (root included) a draft can have: the tree budget the static cache is sized for
    # and a compiled verify pads every draft to (required there; None: eager only, the cache grows).
    max_nodes: int | None = None
    # The target's layers from some layer on (then its final norm and lm_head), which the verify runs
    # on drafts that carry ``entry`` states (layer skip shares its first layers' KV with the verify).
    entry_model: nn.Module | None = None

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[Any]:
        """One state per row of a batch, passed back to every other verb: prompts[b] (1, P_b) row b's
        prompt ids (its pad columns dropped; drafters that read token ids keep them), the row reserved
        for ``lengths[b]`` tokens (its prompt + max_new_tokens). Drafters are stateless: the generator
        holds the states. The first ``observe_rows`` follows, with the prompt's features."""
        raise NotImplementedError

    def observe_rows(self, states: list[Any], features: list[Tensor], next_tokens: list[Tensor]) -> None:
        """The rows' newly accepted tokens: features[i] (1, A_i, F) the target's features at them,
        next_tokens[i] (1, A_i) the token after each (the last one is the row's next root)."""
        raise NotImplementedError

    def propose_rows(self, states: list[Any], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        """One draft per row, row i's rooted at ``roots[i]`` (0-d long) with at most ``max_depths[i]``
        draft levels."""
        raise NotImplementedError

    def before_draft(self, cache: Any, lengths: list[int], pads: list[int]) -> None:
        """The target's cache (``infer.cache.StaticKVCache``) as this step's drafts find it: row b's
        accepted tokens in slots [pads[b], lengths[b]). Called by an eager generator before every
        ``propose_rows``; a drafter that shares the target's KV (layer skip) drafts into it."""

    def begin(self, sampling: Sampling, rows: int = 1) -> None:
        """A decode of ``rows`` rows with this ``sampling`` starts: called by the generator before ``new_rows``; a
        drafter whose policy depends on the sampling mode or the batch (``free.by_temperature``) picks it here, a
        wrapper passes it on."""

    def use_step_costs(self, costs: Any) -> bool:
        """The step costs (``infer.cost_model.StepCosts``) a cost-aware chooser drafts this step under, or None
        (its profile's forced steps). True: this drafter cuts its drafts itself under them (DSpark's confidence),
        so a row the chooser lets draft drafts as much as it may and is cut after drafting."""
        return False

    def compile_with(self, compile: bool | str) -> None:
        """The generator's ``compile`` switch (``infer.compiling.compiled``), given once it is built: a
        drafter with a fixed-shape draft step compiles it; the rest draft eagerly."""


@functools.lru_cache(maxsize=64)
def chain_buffers(num_drafts: int, device: torch.device) -> TreeBuffers:
    """Buffers of a chain of ``num_drafts`` (built once per length and device: they never change,
    and no consumer writes into them)."""
    return tree_from_parents(chain_parents(num_drafts), device)


def root_only(root: Tensor) -> Draft:
    return Draft(tokens=root.reshape(1), tree=chain_buffers(0, root.device))


def stack_rows(rows: int, index: list[int], pieces: list[Tensor]) -> tuple[Tensor, list[int]]:
    """Pieces (1, A_i, ...) of the rows ``index`` as one (rows, max A_i, ...) tensor (zeros where a
    row has fewer entries or is absent), and each row's count (0 for an absent row)."""
    width = max(p.shape[1] for p in pieces)
    out = pieces[0].new_zeros(rows, width, *pieces[0].shape[2:])
    counts = [0] * rows
    for b, piece in zip(index, pieces):
        out[b, : piece.shape[1]] = piece[0]
        counts[b] = piece.shape[1]
    return out, counts


def group_rows(states: list[Any]) -> dict[int, list[int]]:
    """Positions in ``states`` grouped by the buffers they share (``state.cache``): one group per
    batch (or per single-row state)."""
    groups: dict[int, list[int]] = {}
    for i, state in enumerate(states):
        groups.setdefault(id(state.cache), []).append(i)
    return groups


def draft_by_batch(states: list[Any], roots: list[Tensor], max_depths: list[int], length: int,
                   draft: Callable[[Any, list[Any], list[Tensor], list[int]], list[Draft]]) -> list[Draft]:
    """Each row's draft, in ``states``' order: the rows sharing a batch cache drafted together by
    ``draft(cache, states, roots, lengths)``, every row at most ``length`` deep and within its ``max_depths``."""
    drafts: list[Draft] = [None] * len(states)  # type: ignore[list-item]
    for group in group_rows(states).values():
        lengths = [min(length, max_depths[i]) for i in group]
        out = draft(states[group[0]].cache, [states[i] for i in group], [roots[i] for i in group], lengths)
        for i, one in zip(group, out):
            drafts[i] = one
    return drafts


def chain_draft(tokens: list[Tensor], q: list[Tensor]) -> Draft:
    ids = torch.stack(tokens)  # (N,)
    return Draft(ids, chain_buffers(len(tokens) - 1, ids.device), torch.stack(q) if q else None)


class HeadDrafter(Drafter):
    """The drafter of a trained head kind: built from (head, target, draft shape); says which draft
    shape it takes by default on a device. One module per kind, ``infer/drafters/<kind>.py``,
    names its class ``DRAFTER`` (see ``infer.drafters.drafter_class``)."""

    def __init__(self, head: nn.Module, target: nn.Module, tree: TreeOption, confidence: float | None = None) -> None:
        raise NotImplementedError

    @classmethod
    def branching_tree(cls, device: torch.device) -> StaticTree | DynamicTree:
        """The kind's tree-shaped draft on ``device``."""
        raise NotImplementedError

    @classmethod
    def default_tree(cls, device: torch.device) -> TreeOption:
        """What a generator drafts when given no shape (``branching_tree`` unless a kind says otherwise)."""
        return cls.branching_tree(device)

    @classmethod
    def adapts_by_default(cls, device: torch.device) -> bool:
        """Whether the default drafter on ``device`` is a chain whose length follows the acceptance
        (``infer.drafters.adaptive_chain``) rather than ``default_tree``."""
        return False

    @staticmethod
    def longest_chain(head: nn.Module) -> int:
        """The longest chain this head can draft (for a CLI's ``--chain`` range)."""
        return 16

    def rewind_rows(self, states: list[Any], lengths: list[int]) -> None:
        """Forget every observed (feature, next token) pair of row i past its first ``lengths[i]``: the
        text that row read was cut back (a head nested in a draft LM's own decoding,
        ``infer.drafters.free.hierarchical``). The next call is ``observe_rows`` of the pairs from there on."""
        raise NotImplementedError(f"{type(self).__name__} cannot be rewound")

    shapes: tuple[type, ...] = (Chain,)  # the draft shapes this kind takes

    @classmethod
    def fits(cls, head: nn.Module, tree: TreeOption) -> bool:
        """Whether ``head`` can draft ``tree``."""
        return isinstance(tree, cls.shapes) and (not isinstance(tree, Chain) or tree.length <= cls.longest_chain(head))
