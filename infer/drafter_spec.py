"""Drafter specs: the one parser of the strings that name a drafter (the CLI's ``--drafter`` and ``--head``, the
benchmark's methods), and the one builder turning a parsed spec into a drafter for a loaded target.

    ngram                      prompt lookup (infer.drafters.free.ngram)
    layer-skip | layer-skip:K  the target's own first K layers draft (infer.drafters.free.layer_skip; no K: the
                               calibrated K, else half the layers)
    lm:DIR                     a small LM sharing the target's tokenizer (infer.drafters.free.lm_drafter)
    lm:DIR+ngram               the same, its own drafts guessed by prompt lookup (infer.drafters.free.hierarchical)
    lm:DIR+head:HEAD           the same, guessed by a head trained on the draft LM
    head:DIR                   a trained draft head (its kind's drafter, infer.drafters.make_drafter)
    head:DIR+lookup-first      prompt lookup first, the head when lookup finds nothing (infer.drafters.free.lookup_first)

``parse_drafter`` only reads the string (no torch: the CLI checks its arguments before loading anything); a
bad spec is one line naming it and the forms above. A new drafter spec is a form here and a branch in
``build_drafter``.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from draftsmith.infer.drafters import Drafter, TreeOption

FORMS = "ngram, layer-skip[:K], lm:DIR, lm:DIR+ngram, lm:DIR+head:HEAD, head:DIR or head:DIR+lookup-first"
_LAYER_SKIP = re.compile(r"layer-skip(?::([1-9][0-9]*))?")
KINDS = ("ngram", "layer-skip", "lm", "head")


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter spec."""

    kind: str  # one of KINDS
    path: str | None = None  # lm: the draft LM (directory, Hub id or demo:<name>); head: the head
    guess: str | None = None  # lm: who guesses the draft LM's own drafts: None, "ngram" or "head:HEAD"
    layers: int | None = None  # layer-skip: K (None: the calibrated K, else half the layers)
    lookup_first: bool = False  # head: prompt lookup before it

    def describe(self) -> str:
        """A few words for a report line."""
        if self.kind == "lm":
            return "draft LM drafter" + ({"ngram": " + n-grams"}.get(self.guess, " + its head") if self.guess else "")
        if self.kind == "layer-skip":
            return "layer-skip drafter" if self.layers is None else f"layer-skip:{self.layers} drafter"
        return f"{self.kind} drafter" + (" behind prompt lookup" if self.lookup_first else "")


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"drafter spec {spec!r}: {why} (use {FORMS})")


def parse_drafter(spec: str) -> DrafterSpec:
    """``spec`` -> its ``DrafterSpec``; ValueError, one line naming the spec, for anything else."""
    if not isinstance(spec, str):
        raise _bad(str(spec), f"a spec is a string, got {type(spec).__name__}")
    if spec == "ngram":
        return DrafterSpec("ngram")
    layer_skip = _LAYER_SKIP.fullmatch(spec)
    if layer_skip:
        return DrafterSpec("layer-skip", layers=int(layer_skip.group(1)) if layer_skip.group(1) else None)
    if spec.startswith("lm:"):
        body = spec.removeprefix("lm:")
        if "+head:" in body:
            path, head = body.split("+head:", 1)
            guess = "head:" + head if head else ""
        elif body.endswith("+ngram"):
            path, guess = body.removesuffix("+ngram"), "ngram"
        else:
            path, guess = body, None
        if not path or guess == "":
            raise _bad(spec, f"names no {'draft LM directory' if not path else 'head'}")
        return DrafterSpec("lm", path=path, guess=guess)
    if spec.startswith("head:"):
        body = spec.removeprefix("head:")
        path = body.removesuffix("+lookup-first")
        if not path:
            raise _bad(spec, "names no head directory")
        return DrafterSpec("head", path=path, lookup_first=path != body)
    if spec.startswith("layer-skip"):
        raise _bad(spec, "K is a layer count >= 1")
    raise _bad(spec, "unknown drafter")


def build_drafter(spec: DrafterSpec, target: nn.Module, length: int | None = None, *, adaptive: bool = False,
                  branches: int = 1, max_ngram: int = 3, confidence: float | None = None, tree: TreeOption | None = None,
                  loaded: dict[str, Any] | None = None) -> Drafter:
    """The drafter ``spec`` names for a loaded ``target``.

    ``length``: the chain's drafts (default: 8 for n-grams, 4 otherwise; 16 with ``adaptive``); ``adaptive``: the
    length follows the acceptance (``AdaptiveLength`` from min(4, length) up to length; a head: its kind's
    adaptive chain); ``branches``, ``max_ngram``: the n-gram drafter's; ``confidence``: a draft LM stops below
    it; ``tree``: a head's tree (None: its kind's default on the target's device); ``loaded``: models already
    loaded, by their spec path (a draft LM, a head), used instead of loading them again."""
    from draftsmith.infer.drafters import AdaptiveLength, Chain

    loaded = {} if loaded is None else loaded
    if spec.kind == "head":
        return _head_drafter(spec, target, tree, adaptive, loaded)
    length = length or (16 if adaptive else 8 if spec.kind == "ngram" else 4)
    if spec.kind == "ngram":
        from draftsmith.infer.drafters.free.ngram import NgramDrafter

        drafter = NgramDrafter(max_ngram=max_ngram, length=length, branches=branches)
    elif spec.kind == "layer-skip":
        from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter

        drafter = LayerSkipDrafter(target, spec.layers, Chain(length))
        if spec.layers is None:
            how = "calibrated" if drafter.calibrated else \
                "no calibration for this target (scripts/calibrate_layer_skip.py); half its layers"
            print(f"layer skip: k={drafter.layers} ({how})", file=sys.stderr)
    else:
        drafter = _draft_lm_drafter(spec, target, length, max_ngram, confidence, loaded)
    return AdaptiveLength(drafter, initial=min(4, length), maximum=length) if adaptive else drafter


def _draft_lm_drafter(spec: DrafterSpec, target: nn.Module, length: int, max_ngram: int, confidence: float | None,
                      loaded: dict[str, Any]) -> Drafter:
    """``lm:DIR[+ngram|+head:HEAD]``: the draft LM (loaded on the target's device and dtype), alone or with its
    own drafts guessed."""
    from transformers import AutoModelForCausalLM

    from draftsmith.data.targets import resolve_target
    from draftsmith.heads import AutoHead
    from draftsmith.infer.drafters import Chain, head_drafter_class, make_drafter
    from draftsmith.infer.drafters.free.hierarchical import HierarchicalDrafter
    from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
    from draftsmith.infer.drafters.free.ngram import NgramDrafter

    model = loaded.get(spec.path)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(resolve_target(spec.path, role="draft LM"),
                                                     dtype=target.dtype).to(target.device)
    if spec.guess is None:
        return LMDrafter(model, target, Chain(length), confidence=confidence)
    if spec.guess == "ngram":
        guesser = NgramDrafter(max_ngram=max_ngram, length=length)
    else:  # a head trained on the draft LM guesses up to a chain of the same length
        name = spec.guess.removeprefix("head:")
        head = loaded[name] if name in loaded else AutoHead.from_pretrained(name)
        head = head.to(device=target.device, dtype=target.dtype).eval()
        guesser = make_drafter(head, model, Chain(min(length, head_drafter_class(head).longest_chain(head))))
    return HierarchicalDrafter(model, target, guesser, Chain(length))


def _head_drafter(spec: DrafterSpec, target: nn.Module, tree: TreeOption | None, adaptive: bool,
                  loaded: dict[str, Any]) -> Drafter:
    """``head:DIR[+lookup-first]``: the head (checked against the target, moved to its device and dtype) drafting
    ``tree`` (its kind's adaptive chain with ``adaptive``), behind prompt lookup with ``+lookup-first``."""
    from draftsmith.heads import AutoHead
    from draftsmith.infer.drafters import adaptive_chain, make_drafter
    from draftsmith.infer.drafters.free.lookup_first import LookupFirst
    from draftsmith.infer.drafters.free.ngram import NgramDrafter

    head = loaded[spec.path] if spec.path in loaded else AutoHead.from_pretrained(spec.path)
    head.check_target(target)
    head.to(device=target.device, dtype=target.dtype).eval()
    drafter = adaptive_chain(head, target) if adaptive else make_drafter(head, target, tree)
    return LookupFirst(drafter, NgramDrafter(max_ngram=3, length=8)) if spec.lookup_first else drafter


__all__ = ["FORMS", "KINDS", "DrafterSpec", "build_drafter", "parse_drafter"]
