"""docs/design.md names only what exists: every path of ours it cites (``infer/rollback.py``, ``tests/support/``), every
dotted name (``heads.auto.HEAD_CLASSES``, ``infer.tree.select_trees(...)``), every config key (``train.loss``) and
every bare name of ours it calls or capitalises (``make_rollback(...)``, ``SpeculativeGenerator``). A planted stale
name of each form is reported."""
from __future__ import annotations

import ast
import builtins
import dataclasses
import re
from functools import cache
from pathlib import Path

from support.house import LAYERS, REPO

DOC = REPO / "docs" / "design.md"
FOLDERS = (*LAYERS, "tests", "configs", "docs", "lab")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(FOLDERS) + r")/[\w./<>-]*)")
DOTTED = re.compile(r"^(?:draftsmith\.)?((?:" + "|".join(LAYERS) + r")(?:\.\w+)+)")
CONFIG = re.compile(r"^(head|data|train|log)\.(\w+(?:\.\w+)*)")
CALL = re.compile(r"^([A-Za-z_]\w*)\(")
CLASS = re.compile(r"^([A-Z][a-z]+[A-Z]\w*|[A-Z][a-z]+[a-z]+)$")  # CamelCase words: class names
EXTERNAL = {"PreTrainedModel", "PretrainedConfig", "DynamicCache", "StaticCache", "Tensor", "None", "True", "False",
            "Linear", "Embedding", "ModuleList", "Module", "Identity", "GenerationMixin", "Accelerator",
            "LlamaForCausalLM", "Eagle3Speculator", "PEagleSpeculator", "AutoModelForCausalLM", "AutoTokenizer",
            *dir(builtins)}


def library_files() -> list[Path]:
    return sorted(p for layer in LAYERS for p in (REPO / layer).rglob("*.py"))


@cache
def defined_names() -> frozenset[str]:
    """Every name our library binds: functions, classes, module and class attributes, ``self.x`` attributes."""
    names: set[str] = set()
    for path in library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for leaf in ast.walk(target):
                        if isinstance(leaf, ast.Name):
                            names.add(leaf.id)
                        elif isinstance(leaf, ast.Attribute):
                            names.add(leaf.attr)
    return frozenset(names)


def _module_file(parts: list[str]) -> Path | None:
    base = REPO.joinpath(*parts)
    return next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)


def _bound(body: list[ast.stmt], name: str) -> ast.AST | bool:
    """What binds ``name`` among ``body``'s statements: its def or class node, True for an import or an assignment
    (nothing further to check), False for nothing."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[0] == name
                                                                  for a in node.names):
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in {
                leaf.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for leaf in ast.walk(t) if isinstance(leaf, ast.Name)}:
            return True
    return False


def _binds(path: Path, chain: list[str]) -> bool:
    """Whether ``path``'s module binds ``chain[0]`` at top level and, for a class, ``chain[1]`` inside it (a method,
    a class attribute, or a ``self.x`` its methods set)."""
    found = _bound(ast.parse(path.read_text()).body, chain[0])
    if len(chain) == 1 or found is True:
        return bool(found)
    if not isinstance(found, ast.ClassDef):
        return False
    return bool(_bound(found.body, chain[1])) or any(
        isinstance(n, ast.Attribute) and n.attr == chain[1] and isinstance(n.ctx, ast.Store) for n in ast.walk(found))


def dotted_exists(dotted: str) -> bool:
    """``infer.tree.select_trees`` or ``heads.formats.Format``: the longest module prefix, then names bound in it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is not None:
            return cut == len(parts) or _binds(path, parts[cut:])
    return False


@cache
def config_keys() -> frozenset[str]:
    from draftsmith.train.settings import TrainConfig

    keys: set[str] = set()

    def walk(cls: type, prefix: str) -> None:
        for field in dataclasses.fields(cls):
            keys.add(prefix + field.name)
            kind = field.default_factory if field.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{field.name}.")
    walk(TrainConfig, "")
    return frozenset(keys)


def stale_names(text: str) -> list[str]:
    """``line: name`` for every name of ours in ``text`` that the repository does not have."""
    stale, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:  # code: the functions and classes it defines, the dotted names it calls
            names = re.findall(r"^\s*(?:def|class) (\w+)", line)
            stale += [f"{number}: {name}" for name in names if name not in defined_names()]
            stale += [f"{number}: {name}" for name in re.findall(r"(?<![\w.])((?:" + "|".join(LAYERS) + r")\.[\w.]*\w)", line)
                      if not dotted_exists(name)]
            continue
        for path in PATH.findall(line):
            clean = path.rstrip(".,;:)")
            if "<" not in clean and not (REPO / clean).exists():
                stale.append(f"{number}: {clean}")
        for code in re.findall(r"`([^`]+)`", line):
            code = code.strip()
            head = code.split("(")[0].split(" ")[0].split("=")[0]
            if "/" in head:
                continue  # a path: checked above
            if re.fullmatch(r"\w+\.py", head):  # a module by its file name: one of ours somewhere
                if not any((REPO / layer).rglob(head) for layer in LAYERS):
                    stale.append(f"{number}: {head}")
                continue
            if (config := CONFIG.match(head)) and not head.endswith("*"):
                if f"{config.group(1)}.{config.group(2)}" not in config_keys() and not dotted_exists(head):
                    stale.append(f"{number}: {head}")
            elif (dotted := DOTTED.match(head)) and not CONFIG.match(head):
                if not dotted_exists(dotted.group(1)):
                    stale.append(f"{number}: {head}")
            elif (call := CALL.match(code)) and call.group(1) not in defined_names() | EXTERNAL:
                stale.append(f"{number}: {call.group(1)}")
            elif CLASS.match(code) and code not in defined_names() | EXTERNAL:
                stale.append(f"{number}: {code}")
    return stale


def test_the_design_doc_names_only_what_exists():
    assert stale_names(DOC.read_text()) == []


def test_the_check_can_fail():
    """Plants: a deleted function called, a module path and a dotted name that moved, a stale class, a config key
    that is gone; the live forms of each pass."""
    planted = ("`compact(prefix, nodes)` and `infer/target.py` and `infer.target.target_forward`\n"
               "`NoSuchRollback` and `train.no_such_key` and `heads.auto.NO_SUCH`\n"
               "`make_rollback(...)` `target/model.py` `target.model.target_forward` `heads.auto.HEAD_CLASSES` "
               "`train.loss` `SpeculativeGenerator` `tests/support/`\n"
               "```python\ndef no_such_function(model) -> dict\nheads.build_head(kind)  heads.no_such(x)\n"
               "def decoder_layers(model)\n```\n")
    assert stale_names(planted) == ["1: infer/target.py", "1: compact", "1: infer.target.target_forward",
                                    "2: NoSuchRollback", "2: train.no_such_key", "2: heads.auto.NO_SUCH",
                                    "5: no_such_function", "6: heads.no_such"]
