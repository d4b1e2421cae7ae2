"""Drafters: ``base`` (what every drafter is), one module per head kind (``<kind>.py``, its class
named ``DRAFTER``), one per variant with a class of its own in ``variants/`` (``<variant>.py``, a subclass of
its kind's drafter), the lookup from a head to its drafter, and in ``free/`` the drafters that are no head
kind: ``adaptive`` (a chain whose length follows the acceptance), ``chooser`` (a chain's length or a dynamic
tree's depth chosen for tokens per second, 0 allowed), ``by_temperature`` (one of those two per sampling mode: the
CPU default), ``lm_drafter`` (a small LM), ``layer_skip`` (the target's first layers), ``ngram`` (prompt lookup), ``lookup_first`` (prompt lookup, else another
drafter) and ``hierarchical`` (a draft LM whose own drafts are guessed). Import those from their modules."""
from __future__ import annotations

import importlib

import torch
from torch import nn

from draftsmith.infer.drafters.free.adaptive import AdaptiveLength
from draftsmith.infer.drafters.free.by_temperature import ByTemperature
from draftsmith.infer.drafters.free.chooser import CostAwareLength
from draftsmith.infer.drafters.base import (
    Chain,
    Draft,
    Drafter,
    DynamicTree,
    HeadDrafter,
    Sampling,
    StaticTree,
    TreeOption,
    chain_buffers,
    chain_draft,
    root_only,
)


def drafter_class(kind: str, variant: str | None = None) -> type[HeadDrafter]:
    """The drafter class of head kind ``kind`` (module ``infer.drafters.<kind>``, ``-`` read as ``_``), or of its
    ``variant`` where that has a class of its own (``heads.kinds.VARIANT_CLASSES``: module
    ``infer.drafters.variants.<variant>``)."""
    from draftsmith.heads.kinds import HEAD_CLASSES, VARIANT_CLASSES

    if kind not in HEAD_CLASSES:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(HEAD_CLASSES)}")
    if (kind, variant) in VARIANT_CLASSES:
        return importlib.import_module(f"draftsmith.infer.drafters.variants.{variant}").DRAFTER
    return importlib.import_module(f"draftsmith.infer.drafters.{kind.replace('-', '_')}").DRAFTER


def head_drafter_class(head: nn.Module) -> type[HeadDrafter]:
    """The drafter class of ``head``: its kind's, or its variant's (``drafter_class``)."""
    config = getattr(head, "config", None)
    return drafter_class(getattr(head, "head_kind", None), getattr(config, "variant", None))


def default_branching_tree(kind: str, device: torch.device | str) -> StaticTree | DynamicTree:
    """The kind's tree-shaped draft on ``device`` (Medusa's static tree, an EAGLE-2 dynamic tree)."""
    return drafter_class(kind).branching_tree(torch.device(device))


def default_tree(kind: str, device: torch.device | str) -> TreeOption:
    """What a generator drafts for a ``kind`` head when given no draft shape."""
    return drafter_class(kind).default_tree(torch.device(device))


def make_drafter(head: nn.Module, target: nn.Module, tree: TreeOption | None = None,
                 confidence: float | None = None) -> HeadDrafter | ByTemperature:
    """The drafter for a head's kind drafting ``tree``; ``tree=None``: the kind's default on the
    target's device (``default_tree``, or ``default_chain`` where the kind ``adapts_by_default``:
    EAGLE heads on CPU, adaptive for one greedy row and cost-aware otherwise); ``confidence``: EAGLE greedy
    chains stop a level early below this head probability."""
    cls = head_drafter_class(head)
    device = target.get_input_embeddings().weight.device
    if tree is None and cls.adapts_by_default(device):
        return default_chain(head, target, confidence)
    return cls(head, target, tree or fit_chain(head, cls.default_tree(device)), confidence)


def fit_chain(head: nn.Module, tree: TreeOption) -> TreeOption:
    """A default ``tree`` that fits ``head``: a chain longer than the head drafts (a DFlash head of
    block_size 4 drafts 3) is cut to its longest; a tree the head cannot draft (a P-EAGLE head drafts chains
    only) becomes its longest chain; anything else is returned as it is. For defaults only: a length the user
    asked for is checked by the drafter, never cut."""
    cls = head_drafter_class(head)
    if isinstance(tree, Chain) or not cls.fits(head, tree):
        return Chain(min(tree.length if isinstance(tree, Chain) else cls.longest_chain(head), cls.longest_chain(head)))
    return tree


def adaptive_chain(head: nn.Module, target: nn.Module, confidence: float | None = None) -> AdaptiveLength:
    """The head's chain with its length following the acceptance (``AdaptiveLength``: from 4, +2 after
    a fully accepted step, -1 otherwise), up to the longest chain the kind drafts (Medusa: its heads)."""
    cls = head_drafter_class(head)
    longest = cls.longest_chain(head)
    return AdaptiveLength(cls(head, target, Chain(longest), confidence), initial=min(4, longest), maximum=longest)


def default_chain(head: nn.Module, target: nn.Module, confidence: float | None = None) -> ByTemperature:
    """The head's chain where its kind ``adapts_by_default`` (EAGLE heads on CPU), one drafter under two length
    policies (``ByTemperature``): one row at temperature 0 the adaptive chain (``adaptive_chain``'s), above it or for
    a batch the cost-aware one (``chosen_chain``'s, 0 allowed: sampled drafts are kept too seldom to draft every
    step, and a batch's verify carries every row's chain)."""
    cls = head_drafter_class(head)
    longest = cls.longest_chain(head)
    inner = cls(head, target, Chain(longest), confidence)
    return ByTemperature(AdaptiveLength(inner, initial=min(4, longest), maximum=longest),
                         CostAwareLength(inner, maximum=longest))


def chosen_chain(head: nn.Module, target: nn.Module, confidence: float | None = None) -> CostAwareLength:
    """The head's chain with each step's length chosen for tokens per second from the rows' acceptance and the
    measured step costs (``CostAwareLength``: 0 to the longest chain the kind drafts). Opt-in (``--choose``): on the
    busy 2-core box it matched the adaptive chain sampled and lost to it greedy (docs/benchmarks.md)."""
    cls = head_drafter_class(head)
    longest = cls.longest_chain(head)
    return CostAwareLength(cls(head, target, Chain(longest), confidence), maximum=longest)


def chosen_tree(head: nn.Module, target: nn.Module, tree: DynamicTree | None = None) -> CostAwareLength:
    """The head's dynamic ``tree`` (None: its kind's, ``branching_tree`` on the target's device) with each step's
    depth chosen as ``chosen_chain`` chooses a chain's length: 0 to the tree's depth, a tree cut to k levels keeping
    its most likely nodes (at 1: the root's ``top_k`` best children). Opt-in (``--choose --tree tree`` or
    ``dynD-K-N``)."""
    cls = head_drafter_class(head)
    tree = tree or cls.branching_tree(target.get_input_embeddings().weight.device)
    if not isinstance(tree, DynamicTree) or not cls.fits(head, tree):
        raise ValueError(f"a chosen tree is a dynamic tree a {head.head_kind} head drafts, got {tree!r}")
    return CostAwareLength(cls(head, target, tree), maximum=tree.depth)


__all__ = ["AdaptiveLength", "ByTemperature", "CostAwareLength", "Chain", "Draft", "Drafter", "DynamicTree", "HeadDrafter", "Sampling",
           "StaticTree", "TreeOption", "chain_buffers", "chain_draft", "root_only", "drafter_class", "head_drafter_class",
           "default_branching_tree", "default_tree", "make_drafter", "adaptive_chain", "default_chain", "chosen_chain",
           "chosen_tree", "fit_chain"]
