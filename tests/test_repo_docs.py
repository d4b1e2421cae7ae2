"""Files cite only documents the repository contains."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines()
            if line.endswith((".py", ".md", ".yaml", ".toml", ".txt")) and (ROOT / line).is_file()]


def test_every_cited_document_exists():
    cited = re.compile(r"\b((?:docs/)?[A-Za-z][\w-]*\.md)\b")
    missing = []
    for path in _tracked():
        if path.name == Path(__file__).name:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in cited.findall(line):
                if name.startswith("docs/") or name.isupper() or name.split(".")[0].isupper():
                    candidates = [ROOT / name, path.parent / name]
                    if not any(c.is_file() for c in candidates) and name != "README.md":
                        missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, missing


def test_no_file_cites_the_missing_reference_notes():
    assert not [str(p.relative_to(ROOT)) for p in _tracked()
                if p.name != Path(__file__).name and "REFERENCE" in p.read_text(errors="replace")]


def test_readme_says_what_the_torch_pin_does_and_gives_one_thread_advice():
    readme = (ROOT / "README.md").read_text()
    assert "does not pull CUDA wheels" not in readme  # the pin selects a version, not a build
    assert "download.pytorch.org/whl/cpu" in readme
    assert "--num_cpu_threads_per_process 2` to use\nboth cores" not in readme and "--threads N" in readme
