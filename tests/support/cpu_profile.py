"""CPU seconds per test file and per test, for finding what the suite spends (docs/testing.md): with
``DRAFTSMITH_TEST_CPU=out.json`` set, each pytest process (each xdist worker) writes
``out.json`` (``out.<worker>.json`` under xdist; rewritten after each file) with user+sys seconds of the process and of the subprocesses
it waited for, per file and per test (a file's module fixtures count in its first and last tests). Wall
seconds on a shared box say little; CPU seconds do not depend on what else runs. Off when unset."""
from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

_ENV = "DRAFTSMITH_TEST_CPU"
_FILES: dict[str, dict[str, float]] = {}
_TESTS: dict[str, float] = {}


def _cpu() -> tuple[float, float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, time.perf_counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get(_ENV):
        yield
        return
    before = _cpu()
    yield
    spent = [b - a for a, b in zip(before, _cpu())]
    row = _FILES.setdefault(item.location[0], {"self": 0.0, "children": 0.0, "wall": 0.0, "tests": 0})
    for key, value in zip(("self", "children", "wall"), spent):
        row[key] += value
    row["tests"] += 1
    _TESTS[item.nodeid] = spent[0] + spent[1]
    if nextitem is None or nextitem.location[0] != item.location[0]:
        _write()  # after every file: a run stopped part-way (a timeout) still leaves what it measured


def pytest_sessionfinish(session):
    _write()


def _write() -> None:
    out = os.environ.get(_ENV)
    if not out or not _FILES:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = Path(out) if worker is None else Path(out).with_suffix(f".{worker}.json")
    path.write_text(json.dumps({"files": _FILES, "tests": _TESTS}, indent=1, sort_keys=True))
