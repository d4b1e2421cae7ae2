"""scripts/rank_heads.py's rank correlation on hand-made rows, and its refusal of a folder that is no run."""
from __future__ import annotations

import math

import pytest

from draftsmith.scripts.rank_heads import parse_args, ranks, spearman


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
