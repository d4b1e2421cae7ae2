"""The house: each folder imports only the folders below it, and no import circle spans two files,
nor two parts of ``infer/`` (a subfolder, ``infer/drafters/`` or ``infer/bench/``, counts as one part):
``infer/drafters/`` reads the shared steps beside it (tree, cache, target), which never read a drafter.

Order, lowest first: data < heads < target < infer < train < scripts < lab (our own harnesses, which the
wheel does not install). Every import counts, including the
lazy ones inside functions: a back-edge hidden in a function body still makes the layering a fiction
and still closes a circle at run time.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support.house import LAYERS, REPO as ROOT


def python_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


def module_file(dotted: str) -> Path | None:
    """The file that defines ``dotted`` (a module or a package), or None when it is not ours."""
    parts = dotted.split(".")
    if parts[0] == "draftsmith":
        parts = parts[1:]
    if not parts or parts[0] not in LAYERS:
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return parts[:-1]  # the package the file lives in (for relative imports)


def imported_files(path: Path, source: str | None = None) -> set[Path]:
    """Every file of ours that ``path`` (or ``source``, read as if it were at ``path``) imports."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    found: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path)[: len(_package_of(path)) - node.level + 1]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import sub` names the submodule when there is one
            names = [f"{base}.{alias.name}" if module_file(f"{base}.{alias.name}") else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            target = module_file(name)
            if target is not None and target != path:
                found.add(target)
    return found


def layer_of(path: Path) -> int:
    return LAYERS.index(path.relative_to(ROOT).parts[0])


def graph() -> dict[Path, set[Path]]:
    return {path: imported_files(path) for path in python_files()}


def upward_arrows(edges: dict[Path, set[Path]]) -> list[str]:
    return [f"{src.relative_to(ROOT)} -> {dst.relative_to(ROOT)}"
            for src, targets in edges.items() for dst in targets if layer_of(dst) > layer_of(src)]


def circles(edges: dict[Path, set[Path]]) -> list[list[Path]]:
    """Strongly connected components of two or more files (Tarjan, iterative)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    found: list[list[Path]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def by_part(edges: dict[Path, set[Path]], folder: str = "infer") -> dict[Path, set[Path]]:
    """``edges`` among ``folder``'s files with each of its subfolders drawn as one node (the subfolder)."""
    top = ROOT / folder

    def part(path: Path) -> Path:
        rel = path.relative_to(top)
        return top / rel.parts[0] if len(rel.parts) > 1 else path

    inside = {src: {dst for dst in dsts if dst.is_relative_to(top)} for src, dsts in edges.items() if src.is_relative_to(top)}
    parts: dict[Path, set[Path]] = {}
    for src, dsts in inside.items():
        parts.setdefault(part(src), set()).update(part(dst) for dst in dsts if part(dst) != part(src))
    return parts


def test_no_folder_imports_a_folder_above_it():
    arrows = upward_arrows(graph())
    assert not arrows, "imports that climb the house (data < heads < target < infer < train < scripts < lab):\n" + "\n".join(arrows)


def test_no_import_circle_spans_two_files():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(
        " <-> ".join(str(p.relative_to(ROOT)) for p in component) for component in found)


def test_no_import_circle_spans_two_parts_of_infer():
    found = circles(by_part(graph()))
    assert not found, "import circles between parts of infer/ (a subfolder counts as one):\n" + "\n".join(
        " <-> ".join(str(p.relative_to(ROOT)) for p in component) for component in found)


def test_the_checks_can_fail():
    """The detectors themselves: an upward arrow and a two-file circle are both reported."""
    a, b, c = ROOT / "data" / "a.py", ROOT / "data" / "b.py", ROOT / "train" / "c.py"
    edges = {a: {b}, b: {a}, c: set()}
    assert circles(edges) == [sorted([a, b])]
    assert upward_arrows({a: {c}, c: {a}}) == [f"{a.relative_to(ROOT)} -> {c.relative_to(ROOT)}"]
    lab, front = ROOT / "lab" / "bench.py", ROOT / "scripts" / "bench.py"  # lab/ is the top: nothing below reads it
    assert upward_arrows({lab: {front}, front: {lab}}) == [f"{front.relative_to(ROOT)} -> {lab.relative_to(ROOT)}"]
    # a drafter reading a shared step that reads another drafter: no two-file circle, a circle of parts
    ngram, target, eagle = (ROOT / "infer" / name for name in ("drafters/free/ngram.py", "cache.py", "drafters/eagle.py"))
    edges = {ngram: {target}, target: {eagle}, eagle: set()}
    assert circles(edges) == []
    assert circles(by_part(edges)) == [sorted([ROOT / "infer" / "drafters", target])]


@pytest.mark.parametrize("statement, expected", [
    ("from draftsmith.heads.common import DraftHead", "heads/common.py"),
    ("from draftsmith.heads import common", "heads/common.py"),
    ("import draftsmith.infer.tree", "infer/tree.py"),
    ("from draftsmith.heads import AutoHead", "heads/__init__.py"),
    ("from draftsmith import data", "data/__init__.py"),
    ("from heads.common import DraftHead", "heads/common.py"),
    ("from draftsmith.lab.gpu_report import plan", "lab/gpu_report.py"),  # what the unprefixed-import test below refuses
])
def test_imports_resolve_to_the_most_specific_file(statement, expected):
    source = f"def f():\n    {statement}\n"  # a lazy import counts too
    found = imported_files(ROOT / "scripts" / "probe.py", source)
    assert {p.relative_to(ROOT).as_posix() for p in found} == {expected}


def unprefixed_imports(path: Path, source: str | None = None) -> list[str]:
    """Imports of our folders by their bare names (``import data``, ``from infer.tree import ...``): after
    ``pip install`` only ``draftsmith.<folder>`` exists, and a bare ``data`` is whatever else the user has."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names if name.split(".")[0] in LAYERS]
    return found


def test_every_import_of_ours_goes_through_the_draftsmith_namespace():
    files = [*python_files(), *sorted((ROOT / "tests").rglob("*.py"))]
    found = [line for path in files for line in unprefixed_imports(path)]
    assert not found, "bare imports of our folders (import them as draftsmith.<folder>):\n" + "\n".join(found)
    planted = unprefixed_imports(ROOT / "tests" / "probe.py", "import os\nfrom infer.tree import Tree\nimport data.demo\n")
    assert planted == ["tests/probe.py:2: infer.tree", "tests/probe.py:3: data.demo"]
