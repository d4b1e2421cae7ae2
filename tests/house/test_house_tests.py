"""No file under tests/ imports a test module: the helpers test files share live in tests/support/ (no tests
there), so that running or moving one test file never runs or breaks another's. The check is an ast walk (imports
inside functions too); planted imports of a test module are reported."""
from __future__ import annotations

import ast
from pathlib import Path

from support.house import REPO

TESTS = REPO / "tests"


def names_a_test_module(name: str, tests: Path = TESTS) -> bool:
    top = name.split(".")[0]
    return (top.startswith("test_") or top.endswith("_test") or top == "conftest") and any(tests.rglob(f"{top}.py"))


def imports_of_test_modules(source: str, name: str, tests: Path = TESTS) -> list[str]:
    """``name:line: module`` for every import of a test module (or conftest) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                   [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [f"{name}:{node.lineno}: {m}" for m in modules if names_a_test_module(m, tests)]
    return found


def test_no_test_file_imports_a_test_module():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += imports_of_test_modules(path.read_text(), path.relative_to(TESTS).as_posix())
    assert found == [], f"move what these import into tests/support/ (a module of no tests): {found}"


def test_the_check_can_fail(tmp_path):
    """Plants: imports of a test module at the top, inside a function and as a module are reported; imports of
    tests/support/ modules, of the library and of a non-test module named like one are not."""
    for name in ("test_formats.py", "test_infer_classic.py", "conftest.py"):
        (tmp_path / name).write_text("")
    source = ("import os\nfrom test_formats import x\nfrom support.targets import ARCHES\nimport test_nowhere\n"
              "def f():\n    import test_infer_classic as c\n    from draftsmith.infer import tree\n")
    assert imports_of_test_modules(source, "test_probe.py", tmp_path) == [
        "test_probe.py:2: test_formats", "test_probe.py:6: test_infer_classic"]
    assert imports_of_test_modules("from conftest import free_port\n", "p.py", tmp_path) == ["p.py:1: conftest"]
