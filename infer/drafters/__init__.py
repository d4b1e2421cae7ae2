"""Drafters: ``base`` (what every drafter is), one module per head kind (``<kind>.py``, its class
named ``DRAFTER``), and the lookup from a head to its drafter."""
from __future__ import annotations

import importlib

import torch
from torch import nn

from infer.drafters.base import (
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


def drafter_class(kind: str) -> type[HeadDrafter]:
    """The drafter class of head kind ``kind`` (module ``infer.drafters.<kind>``, ``-`` read as ``_``)."""
    from heads import HEAD_CLASSES

    if kind not in HEAD_CLASSES:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(HEAD_CLASSES)}")
    return importlib.import_module(f"infer.drafters.{kind.replace('-', '_')}").DRAFTER


def default_branching_tree(kind: str, device: torch.device | str) -> StaticTree | DynamicTree:
    """The kind's tree-shaped draft on ``device`` (Medusa's static tree, an EAGLE-2 dynamic tree)."""
    return drafter_class(kind).branching_tree(torch.device(device))


def default_tree(kind: str, device: torch.device | str) -> TreeOption:
    """What a generator drafts for a ``kind`` head when given no draft shape."""
    return drafter_class(kind).default_tree(torch.device(device))


def make_drafter(head: nn.Module, target: nn.Module, tree: TreeOption | None = None,
                 confidence: float | None = None) -> HeadDrafter:
    """The drafter for a head's kind; ``tree=None`` = the kind's default on the target's device;
    ``confidence``: EAGLE greedy chains stop a level early below this head probability."""
    cls = drafter_class(getattr(head, "head_kind", None))
    tree = tree or cls.default_tree(target.get_input_embeddings().weight.device)
    return cls(head, target, tree, confidence)


__all__ = ["Chain", "Draft", "Drafter", "DynamicTree", "HeadDrafter", "Sampling", "StaticTree", "TreeOption",
           "chain_buffers", "chain_draft", "root_only", "drafter_class", "default_branching_tree", "default_tree",
           "make_drafter"]
