"""Report writers (scripts/benchmark.py, scripts/bench_scale.py, lab/gpu_report.py, lab/gpu_lease.py) write only
into a folder that is absent, empty or an earlier report (issue 22, principle 1), and say so before any work starts."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from draftsmith.data.base.paths import REPORT_MARKER, claim_report_dir
from support.house import REPO



def test_absent_empty_and_earlier_reports_are_claimed(tmp_path):
    fresh = claim_report_dir(tmp_path / "new" / "report")
    assert (fresh / REPORT_MARKER).is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (claim_report_dir(empty) / REPORT_MARKER).is_file()
    assert claim_report_dir(fresh) == fresh  # ours: may be rewritten
    legacy = tmp_path / "legacy"  # written before the marker existed, as docs/bench-cpu was
    legacy.mkdir()
    (legacy / "results.json").write_text(json.dumps({"rows": [], "meta": {}}))
    assert (claim_report_dir(legacy) / REPORT_MARKER).is_file()


@pytest.mark.parametrize("files", [{"results.json": '{"my": "numbers"}'}, {"notes.md": "# mine\n"}])
def test_a_folder_of_someone_elses_files_or_a_file_is_refused(tmp_path, files):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in files.items():
        (mine / name).write_text(text)
    with pytest.raises(FileExistsError, match=r"--out .*mine holds files no draftsmith report wrote"):
        claim_report_dir(mine)
    assert sorted(p.name for p in mine.iterdir()) == sorted(files)  # nothing added, nothing changed
    assert all((mine / n).read_text() == t for n, t in files.items())
    single = tmp_path / "results.md"
    single.write_text("mine")
    with pytest.raises(FileExistsError, match=r"--out .*results\.md is a file"):
        claim_report_dir(single)
    assert single.read_text() == "mine"


@pytest.mark.parametrize("script, args", [
    ("scripts/benchmark.py", ["--target", "no-such-target-dir"]),
    ("scripts/bench_scale.py", ["--shape", "llama3.1-8b"]),
    ("lab/gpu_report.py", ["--real", "--smoke", "--work", "WORK"]),
    ("lab/gpu_lease.py", ["--smoke", "--device", "cpu"]),
])
def test_scripts_refuse_the_folder_before_any_work(tmp_path, script, args):
    """One line, exit 2, before the target is loaded or anything runs (a bogus target would be
    named instead if the folder were checked later)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.md").write_text("my numbers\n")
    args = [str(tmp_path / "work") if a == "WORK" else a for a in args]
    proc = subprocess.run([sys.executable, str(REPO / script), *args, "--out", str(mine)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds files no draftsmith report wrote (results.md)" in lines[0], proc.stderr
    assert [p.name for p in mine.iterdir()] == ["results.md"] and (mine / "results.md").read_text() == "my numbers\n"
    assert not (tmp_path / "work").exists()
