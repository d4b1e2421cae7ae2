"""infer.drafter_spec: the one parser of drafter specs (the CLI's --drafter/--head, the benchmark's methods): every
form parses to what it names, a bad spec is one line naming it, and the builder makes the drafter each form names
on a tiny target (loaded models reused, the draft LM's options passed through)."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer.drafter_spec import FORMS, DrafterSpec, build_drafter, parse_drafter
from draftsmith.infer.drafters import AdaptiveLength, Chain
from draftsmith.infer.drafters.free.hierarchical import HierarchicalDrafter
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.infer.drafters.free.lookup_first import LookupFirst
from draftsmith.infer.drafters.free.ngram import NgramDrafter

FORMS_PARSED = {
    "ngram": DrafterSpec("ngram"),
    "layer-skip": DrafterSpec("layer-skip"),
    "layer-skip:3": DrafterSpec("layer-skip", layers=3),
    "lm:demo:assistant": DrafterSpec("lm", path="demo:assistant"),
    "lm:/d/lm": DrafterSpec("lm", path="/d/lm"),
    "lm:/d/lm+ngram": DrafterSpec("lm", path="/d/lm", guess="ngram"),
    "lm:/d/lm+head:/d/h": DrafterSpec("lm", path="/d/lm", guess="head:/d/h"),
    "head:/d/h": DrafterSpec("head", path="/d/h"),
    "head:/d/h+lookup-first": DrafterSpec("head", path="/d/h", lookup_first=True),
}


@pytest.mark.parametrize("spec", sorted(FORMS_PARSED))
def test_every_form_parses_to_what_it_names(spec):
    assert parse_drafter(spec) == FORMS_PARSED[spec]


@pytest.mark.parametrize("spec, why", [
    ("bigram", "unknown drafter"), ("", "unknown drafter"), ("layer-skip:0", "K is a layer count >= 1"),
    ("layer-skip:x", "K is a layer count >= 1"), ("lm:", "names no draft LM directory"),
    ("lm:+ngram", "names no draft LM directory"), ("lm:+head:H", "names no draft LM directory"),
    ("lm:D+head:", "names no head"), ("head:", "names no head directory"),
    ("head:+lookup-first", "names no head directory"), ("ngram+head:H", "unknown drafter"),
])
def test_a_bad_spec_is_one_line_naming_it(spec, why):
    with pytest.raises(ValueError) as err:
        parse_drafter(spec)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"drafter spec {spec!r}: {why}") and FORMS in message


def test_descriptions():
    assert [parse_drafter(s).describe() for s in ("lm:D", "lm:D+ngram", "lm:D+head:H", "ngram", "layer-skip:2",
                                                   "head:H+lookup-first")] == [
        "draft LM drafter", "draft LM drafter + n-grams", "draft LM drafter + its head", "ngram drafter",
        "layer-skip:2 drafter", "head drafter behind prompt lookup"]


def test_the_builder_makes_what_each_form_names(tmp_path):
    target = make_tiny_target("llama", num_layers=4, seed=0)
    draft_lm = make_tiny_target("llama", num_layers=1, seed=4)
    draft_lm.save_pretrained(tmp_path / "lm")
    torch.manual_seed(0)
    build_head("eagle", draft_lm).save_pretrained(tmp_path / "lm-head")

    def build(spec, **options):
        return build_drafter(parse_drafter(spec), target, **options)

    ngram = build("ngram")
    assert isinstance(ngram, NgramDrafter) and (ngram.max_ngram, ngram.length, ngram.branches) == (3, 8, 1)
    ngram = build("ngram", length=5, max_ngram=2, branches=3)
    assert (ngram.max_ngram, ngram.length, ngram.branches) == (2, 5, 3)
    adaptive = build("ngram", adaptive=True)
    assert isinstance(adaptive, AdaptiveLength) and adaptive.drafter.length == 16
    skip = build("layer-skip:2")
    assert isinstance(skip, LayerSkipDrafter) and skip.layers == 2 and skip.option.length == 4
    lm = build(f"lm:{tmp_path / 'lm'}", confidence=0.4)
    assert isinstance(lm, LMDrafter) and lm.confidence == 0.4 and lm.option.length == 4
    assert lm.model is not draft_lm  # loaded from its directory
    reused = build(f"lm:{tmp_path / 'lm'}", loaded={str(tmp_path / "lm"): draft_lm})
    assert reused.model is draft_lm
    hier = build(f"lm:{tmp_path / 'lm'}+ngram", length=6)
    assert isinstance(hier, HierarchicalDrafter) and isinstance(hier.inner, NgramDrafter) and hier.inner.length == 6
    guessed = build(f"lm:{tmp_path / 'lm'}+head:{tmp_path / 'lm-head'}")
    assert isinstance(guessed, HierarchicalDrafter) and not isinstance(guessed.inner, NgramDrafter)
    head = build_head("eagle3", target)
    first = build("head:H+lookup-first", loaded={"H": head})
    assert isinstance(first, LookupFirst) and (first.lookup.max_ngram, first.lookup.length) == (3, 8)
    assert not isinstance(build("head:H", loaded={"H": head}, tree=Chain(3)), LookupFirst)
    assert isinstance(build("head:H", loaded={"H": head}, adaptive=True), AdaptiveLength)
    with pytest.raises(ValueError, match="the inner level needs a head trained on the draft LM"):
        build(f"lm:{tmp_path / 'lm'}+head:H", loaded={"H": head})
