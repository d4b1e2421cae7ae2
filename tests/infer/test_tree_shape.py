"""The one draft-shape language (infer/tree_shape.py): what it parses, what it refuses in one line, the trees it
builds per head kind and device, and that the generate CLI and the benchmark both read it."""
from __future__ import annotations

import pytest

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, StaticTree
from draftsmith.infer.tree_shape import TreeShape, build_tree, parse_tree_shape
from support.targets import make_tiny_target


@pytest.mark.parametrize("text, form, sizes", [
    ("default", "default", ()), ("tree", "tree", ()), ("chain4", "chain", (4,)), (" chain12 ", "chain", (12,)),
    ("dyn8-10-60", "dynamic", (8, 10, 60)), ("medusa15", "medusa", (15,)),
])
def test_shapes_parse(text, form, sizes):
    assert parse_tree_shape(text) == TreeShape(text.strip(), form, sizes)


@pytest.mark.parametrize("text, message", [
    ("chain", "a chain of D drafts is chainD"), ("chain0", "every number must be >= 1"), ("dyn3-2", "expected default"),
    ("dyn3-2-1", "a dynamic tree's N >= 2"), ("Chain4", "expected default, tree, chainN, dynD-K-N or medusaN"),
    ("", "expected default"),
])
def test_bad_shapes_are_one_line_naming_them(text, message):
    with pytest.raises(ValueError) as err:
        parse_tree_shape(text)
    assert f"tree shape {text!r}" in str(err.value) and message in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def heads():
    target = make_tiny_target("llama")
    return {kind: build_head(kind, target) for kind in ("eagle", "eagle3", "medusa", "dflash", "early-exit")}


def test_trees_per_kind_and_device(heads):
    def tree(device, kind, text):
        return build_tree(parse_tree_shape(text), heads[kind], device)

    assert tree("cpu", "eagle3", "default") is None  # the generator's own: on CPU a chain adapting its length
    assert tree("cpu", "eagle3", "chain4") == Chain(4)
    assert tree("cpu", "eagle", "tree") == DynamicTree(depth=5, top_k=2, total_tokens=8)
    assert tree("cuda", "eagle3", "tree") == DynamicTree(depth=8, top_k=10, total_tokens=60)
    assert tree("cpu", "eagle", "dyn6-4-60") == DynamicTree(depth=6, top_k=4, total_tokens=60)
    medusa = tree("cpu", "medusa", "tree")
    assert isinstance(medusa, StaticTree) and len(medusa.choices) == 15
    assert len(tree("cpu", "medusa", "medusa7").choices) == 7
    assert len(tree("cpu", "eagle", "medusa7").choices) == 7  # EAGLE heads draft static trees too (docs/traversal.md)
    assert tree("cpu", "dflash", "tree") == Chain(4)  # DFlash drafts chains: its "tree" is its chain
    for kind, text, message in (("early-exit", "tree", "early-exit heads draft chains only"),
                                ("medusa", "dyn3-2-6", "a medusa head cannot draft it"),
                                ("dflash", "chain40", "its chains: at most")):
        with pytest.raises(ValueError, match=message):
            tree("cpu", kind, text)


def test_the_cli_and_the_benchmark_read_the_same_shapes(capsys):
    """Both parse with parse_tree_shape: a shape one accepts the other accepts, a bad one both refuse alike."""
    from draftsmith.infer.generate_command import parse_args as generate_args
    from support.benchmark import load_script

    bench = load_script()
    for good in ("chain6", "dyn6-4-60", "medusa7", "tree", "default"):
        assert generate_args(["--head", "h", "--prompt", "p", "--tree", good]).shape == parse_tree_shape(good)
        assert bench.parse_args(["--target", "t", "--trees", good]).trees == [good]
    for parse in (lambda: generate_args(["--head", "h", "--prompt", "p", "--tree", "dyn3-2"]),
                  lambda: bench.parse_args(["--target", "t", "--trees", "dyn3-2"])):
        with pytest.raises(SystemExit):
            parse()
        assert "tree shape 'dyn3-2': expected default, tree, chainN" in capsys.readouterr().err
