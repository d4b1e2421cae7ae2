"""Long work reports progress into a log file too (issue 22): lines when stderr is not a terminal."""
from __future__ import annotations

import io

from draftsmith.data.base.progress import LineProgress, progress


def test_lines_name_the_step_the_total_and_the_postfix():
    out = io.StringIO()
    bar = LineProgress(3, "pretrain demo target", every_s=0, stream=out)
    for loss in (3.0, 2.5, 2.0):
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("pretrain demo target: 3/3 (")
    assert "loss=2.000" in lines[-1] and "min left" in lines[0]


def test_a_line_a_minute_not_a_line_a_step():
    out = io.StringIO()
    bar = LineProgress(1000, "x", every_s=60, stream=out)
    for _ in range(999):
        bar.update()
    assert out.getvalue() == ""  # within the first minute: silent until the end
    bar.update()
    assert out.getvalue().startswith("x: 1000/1000")


def test_a_log_file_gets_lines(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    assert isinstance(progress(5, "y"), LineProgress)
    assert not isinstance(progress(5, "y", enabled=False), LineProgress)
