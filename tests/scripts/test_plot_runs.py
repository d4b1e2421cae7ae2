"""scripts/plot_runs.py: held-out τ curves of several runs on one plot; bad runs named in one line."""
from __future__ import annotations

import json

import pytest

from draftsmith.scripts.plot_runs import main, tau_curve


def _run(directory, taus):
    directory.mkdir()
    lines = [{"step": 10 * (i + 1), "loss": 1.0} for i in range(len(taus))]
    lines += [{"step": 10 * (i + 1), "acc": [0.1], "tau": tau} for i, tau in enumerate(taus)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return directory


def test_curves_and_plot(tmp_path, capsys):
    a, b = _run(tmp_path / "a", [1.1, 1.3, 1.25]), _run(tmp_path / "b", [1.0, 1.4])
    assert tau_curve(a) == [(10, 1.1), (20, 1.3), (30, 1.25)]
    assert main(["--runs", str(a), str(b), "--labels", "A", "B", "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "A: last τ 1.250 (step 30), best 1.300" in out and "B: last τ 1.400 (step 20), best 1.400" in out


def test_bad_input_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="no evaluation records"):
        tau_curve(empty)
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        tau_curve(tmp_path)
    with pytest.raises(SystemExit):  # argparse: one label for two runs
        main(["--runs", str(empty), str(empty), "--labels", "x", "--out", str(tmp_path / "p.png")])


def test_a_file_not_written_here_is_never_replaced(tmp_path):
    """--out over a file of the user's replaced it; a plot this script wrote is replaced."""
    run = _run(tmp_path / "a", [1.1, 1.3])
    mine = tmp_path / "figure.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n not a plot of ours")
    with pytest.raises(FileExistsError, match=f"--out {mine} exists and is not a plot draftsmith wrote"):
        main(["--runs", str(run), "--out", str(mine)])
    assert mine.read_bytes().endswith(b"not a plot of ours")
    ours = tmp_path / "p.png"
    assert main(["--runs", str(run), "--out", str(ours)]) == 0 and main(["--runs", str(run), "--out", str(ours)]) == 0
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        main(["--runs", str(run), "--out", str(tmp_path / "dir.png")])

