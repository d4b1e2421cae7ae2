"""The one list of head kinds (``HEAD_CLASSES``) and of the variants with classes of their own
(``VARIANT_CLASSES``: (kind, variant) -> head class), and the options each takes."""
from __future__ import annotations

import inspect

from transformers import PretrainedConfig

from draftsmith.heads.common import DraftHead, DraftHeadConfig
from draftsmith.heads.dflash import DFlashHead
from draftsmith.heads.eagle import EagleHead
from draftsmith.heads.eagle3 import Eagle3Head
from draftsmith.heads.early_exit import EarlyExitHead
from draftsmith.heads.medusa import MedusaHead
from draftsmith.heads.mtp import MtpHead
from draftsmith.heads.variants.domino import DominoHead
from draftsmith.heads.variants.dspark import DSparkHead
from draftsmith.heads.variants.peagle import PEagleHead

# The one list of head kinds, each under its config's head_kind. A kind is its head (heads/<kind>.py), its
# training objective (train/objectives/<kind>.py) and its drafter (infer/drafters/<kind>.py), found by name;
# tests/heads/test_kind_contract.py checks the three against their bases.
HEAD_CLASSES: dict[str, type[DraftHead]] = {cls.config_class.head_kind: cls for cls in (
    MedusaHead, EagleHead, Eagle3Head, DFlashHead, EarlyExitHead, MtpHead)}
# The variants with classes of their own, each a subclass of its kind's head and config (heads/variants/<variant>.py),
# with its objective (train/objectives/variants/<variant>.py) and drafter (infer/drafters/variants/<variant>.py)
# subclassing the kind's, found by name; tests/heads/test_kind_contract.py checks them as the kinds.
VARIANT_CLASSES: dict[tuple[str, str], type[DraftHead]] = {
    (cls.config_class.head_kind, cls.config_class.variant): cls for cls in (PEagleHead, DSparkHead, DominoHead)}


def head_class(kind: str, variant: str | None = None) -> type[DraftHead]:
    """The head class of ``kind`` (a key of ``HEAD_CLASSES``) and ``variant``: the variant's own class where it has
    one (``VARIANT_CLASSES``), else the kind's (which checks the variant is one of its own)."""
    if kind not in HEAD_CLASSES:
        raise ValueError(f"unknown head kind '{kind}'; expected one of {sorted(HEAD_CLASSES)}")
    return VARIANT_CLASSES.get((kind, variant), HEAD_CLASSES[kind])


def kind_variants() -> list[tuple[str, str | None]]:
    """Every (kind, variant) with a class: each kind as (kind, None), then each registered variant."""
    return [(kind, None) for kind in HEAD_CLASSES] + list(VARIANT_CLASSES)


def kind_of_variant(variant: str) -> str | None:
    """The kind whose variants (its config's ``variants``) include ``variant``; None when no kind's do."""
    return next((kind for kind, cls in HEAD_CLASSES.items() if variant in getattr(cls.config_class, "variants", ())),
                None)


def config_options(config_cls: type[PretrainedConfig]) -> list[str]:
    """The options a head config takes (its own ``__init__`` parameters and its bases' below
    ``DraftHeadConfig``): what ``build_head`` and ``head.*`` config keys may set."""
    names: list[str] = []
    for cls in config_cls.__mro__:
        if cls in (DraftHeadConfig, PretrainedConfig, object):
            break
        if "__init__" in vars(cls):  # a variant's class may keep its kind's
            names += [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
    return names


def variant_options(kind: str, variant: str | None = None) -> list[str]:
    """The options a ``kind`` head of ``variant`` (None: the kind's own) can take: its class's ``config_options``
    less those the class refuses (``refused_options``: P-EAGLE's EAGLE-3.1 flags) and those another variant of
    the kind owns (the kind config's ``variant_owners``)."""
    cls = head_class(kind, variant).config_class
    variant = variant or getattr(cls, "variant", None)
    owners, refused = getattr(cls, "variant_owners", {}), getattr(cls, "refused_options", ())
    return [name for name in config_options(cls) if name not in refused and owners.get(name, variant) == variant]
