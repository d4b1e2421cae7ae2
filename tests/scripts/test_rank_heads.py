"""scripts/rank_heads.py's rank correlation on hand-made rows, and its refusal of a folder that is no run."""
from __future__ import annotations

import json
import math

import pytest
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.scripts.rank_heads import main, parse_args, ranks, spearman
from draftsmith.train.run import setup


def test_ranks_share_ties():
    assert ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks [1,2,3,4] and [2,1,4,3]: d^2 = 4, rho = 1 - 6*4/(4*15) = 0.6
    assert spearman([1, 2, 3, 4], [5.5, 5.0, 7.0, 6.0]) == pytest.approx(0.6)
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_a_folder_without_metrics_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path)])
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_real_tau_of_a_run_and_its_checkpoint(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "train.max_steps=6", "train.eval_every=3", "train.save_every=3",
                      "train.eval_decode_rows=2", "train.eval_decode_tokens=8"))
    report = tmp_path / "rank.json"
    code = main([str(out), str(out / "checkpoints" / "step-0000003"), "--target", str(tiny_files["target"]),
                 "--prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", "8", "--out", str(report)])
    assert code == 0  # every decode equal to the target's own
    rows = json.loads(report.read_text())["rows"]
    evals = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tau" in r}
    assert [r["step"] for r in rows] == [6, 3]
    for row in rows:  # each head beside its own evaluation
        assert (row["simulated_tau"], row["decode_tau"]) == (evals[row["step"]]["tau"], evals[row["step"]]["decode_tau"])
        assert row["real_tau"] >= 1
