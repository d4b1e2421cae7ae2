"""lab/traversal_tau.py: its arguments and its interval (the decodes themselves are the generator's, tested in
tests/infer/test_infer_traversal.py)."""
from __future__ import annotations

import pytest

from draftsmith.lab.traversal_tau import parse_args, ratio_interval


def test_unknown_variants_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path), "--variants", "exact-fixed,traversal-sampeld"])
    assert "'traversal-sampeld' is not one of" in capsys.readouterr().err
    assert parse_args([str(tmp_path)]).variants[0] == "exact-fixed"  # the ratios' base: today's rule


def test_ratio_interval_brackets_the_pooled_ratio():
    base = [(10, 8), (12, 9), (9, 8), (11, 8)]
    assert ratio_interval(base, base) == (1.0, 1.0)
    more = [(t + 2, s) for t, s in base]  # two more tokens in every decode: 50/33 over 42/33
    low, high = ratio_interval(base, more)
    assert 1.0 < low <= 50 / 42 <= high < 1.4


def test_a_temperature_the_rules_cannot_take_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path), "--temperature", "0"])  # greedy has one rule: nothing to compare
    assert "--temperature" in capsys.readouterr().err
