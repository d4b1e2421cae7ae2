"""The one language of draft shapes, read by ``draftsmith generate --tree`` and ``draftsmith bench --trees``:

    default     the head kind's default on the device (an EAGLE head on CPU: a chain adapting its length)
    tree        the kind's tree-shaped default (Medusa's static tree, an EAGLE-2 dynamic tree)
    chainN      a chain of N drafts
    dynD-K-N    an EAGLE dynamic tree: depth D, K children kept per expanded node, N nodes verified (root included)
    medusaN     the first N nodes of Medusa's mc_sim_7b_63 tree

``parse_tree_shape`` loads nothing (a bad shape is one line before torch loads); ``build_tree`` makes the
tree for a head. The CLI's old ``--tree chain --depth D --branch K --total-tokens N`` are refused with the
shape that says the same.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

FORMS = "default, tree, chainN, dynD-K-N or medusaN"
_SHAPE = re.compile(r"^(?:(default|tree)|chain(\d+)|dyn(\d+)-(\d+)-(\d+)|medusa(\d+))$")


@dataclass(frozen=True)
class TreeShape:
    """A parsed shape: ``form`` is default, tree, chain, dynamic or medusa; ``sizes`` its numbers in order."""

    text: str
    form: str
    sizes: tuple[int, ...] = ()


def parse_tree_shape(text: str) -> TreeShape:
    """``text`` as a shape; a ValueError naming it and the forms otherwise (every number >= 1; a dynamic tree
    verifies at least its root and one node)."""
    match = _SHAPE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        hint = " (a chain of D drafts is chainD, e.g. chain4)" if str(text).strip() == "chain" else ""
        raise ValueError(f"tree shape {text!r}: expected {FORMS}{hint}")
    named, chain, depth, top_k, total, medusa = match.groups()
    if named:
        return TreeShape(text.strip(), named)
    form, sizes = ("chain", (chain,)) if chain else ("dynamic", (depth, top_k, total)) if depth else \
        ("medusa", (medusa,))
    sizes = tuple(int(n) for n in sizes)
    if min(sizes) < 1 or (form == "dynamic" and sizes[2] < 2):
        raise ValueError(f"tree shape {text!r}: every number must be >= 1 (a dynamic tree's N >= 2)")
    return TreeShape(text.strip(), form, sizes)


def build_tree(shape: TreeShape, head, device):
    """The tree ``shape`` names for ``head`` on ``device``; None for ``default`` (what a generator given no tree
    drafts: ``infer.drafters.make_drafter``). A ValueError in one line when the head's kind cannot draft it."""
    import torch

    from draftsmith.infer.drafters import Chain, DynamicTree, StaticTree, head_drafter_class
    from draftsmith.infer.tree import MEDUSA_DEFAULT_CHOICES

    if shape.form == "default":
        return None
    drafter = head_drafter_class(head)  # a variant's own (P-EAGLE drafts chains of its depths)
    if shape.form == "tree":
        tree = drafter.branching_tree(torch.device(device))
        if tree is None:
            raise ValueError(f"tree shape 'tree': {head.head_kind} heads draft chains only; pass chainN (or default)")
    elif shape.form == "chain":
        tree = Chain(*shape.sizes)
    elif shape.form == "dynamic":
        tree = DynamicTree(*shape.sizes)
    else:
        tree = StaticTree(MEDUSA_DEFAULT_CHOICES[: shape.sizes[0]])
    if not drafter.fits(head, tree):
        longest = f" (its chains: at most {drafter.longest_chain(head)} drafts)" if isinstance(tree, Chain) else ""
        raise ValueError(f"tree shape {shape.text!r}: a {head.head_kind} head cannot draft it{longest}")
    return tree
