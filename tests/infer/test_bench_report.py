"""The benchmark table is consistent: speedups follow tokens/s, the bound reads a monotone t(N)."""
from __future__ import annotations

import pytest

from draftsmith.infer.bench.cost import bound, cost_at, monotone
from draftsmith.infer.bench.methods import Method
from draftsmith.infer.bench.report import COLUMNS, UNSTABLE, markdown, summarise


def _method(name: str, runs: list[tuple[int, float]], tau: float = 1.0, n_verify: float = 1.0) -> Method:
    m = Method(name, "vanilla", run=None)
    m.runs = [{"prompt": i, "new_tokens": n, "seconds": s, "forwards": n, "verify_lengths_mean": n_verify,
               "tau": tau, "peak_mem_mb": None, "tokens": [0] * n} for i, (n, s) in enumerate(runs)]
    return m


def test_a_method_slower_in_tokens_per_s_never_shows_as_faster():
    # Per-prompt ratios favour "b" on two short prompts of three, but over all tokens it is slower:
    # a median of per-prompt ratios (the old definition) called it 1.25x faster than vanilla.
    vanilla = _method("vanilla", [(10, 1.0), (10, 1.0), (100, 1.0)])
    b = _method("b", [(10, 0.8), (10, 0.8), (100, 3.0)])
    rows = {r["method"]: r for r in summarise([vanilla, b], {1: 1e-3})}
    assert rows["b"]["tokens_per_s"] < rows["vanilla"]["tokens_per_s"]
    assert rows["b"]["speedup"] < 1.0
    assert rows["b"]["speedup"] == pytest.approx(rows["b"]["tokens_per_s"] / rows["vanilla"]["tokens_per_s"])


def test_the_bound_reads_the_monotone_envelope_of_t_n():
    noisy = {1: 1.0, 4: 0.5, 8: 1.2}  # t(4) < t(1): a slow spell while t(1) was measured
    assert monotone(noisy) == {1: 1.0, 4: 1.0, 8: 1.2}
    assert cost_at(noisy, 4) == pytest.approx(1.0) and cost_at(noisy, 6) == pytest.approx(1.1)
    assert bound(2.0, noisy, 4) == pytest.approx(2.0)  # never tau * t(1) / t(4) = 4.0 > tau
    for n in (1, 2, 4, 6, 8, 16):
        assert bound(3.0, noisy, n) <= 3.0


def test_efficiency_is_the_verify_share_of_a_step():
    # tau 2 over 4-token verifies: 50 tokens in 25 steps of 2 ms each; t(4) = 1.5 ms
    costs = {1: 1e-3, 4: 1.5e-3}
    vanilla = _method("vanilla", [(50, 0.05)])
    spec = _method("spec", [(50, 0.05)], tau=2.0, n_verify=4.0)
    row = summarise([vanilla, spec], costs)[1]
    assert row["bound"] == pytest.approx(2.0 * 1.0 / 1.5)
    assert row["efficiency"] == pytest.approx(1.5e-3 / (0.05 / 25))  # t(4) / seconds per step = 0.75
    assert "efficiency = " in COLUMNS
    table = markdown(summarise([vanilla, spec], costs), costs, {"target": "t", "hardware": "cpu", "dtype": "float32",
                                                                "num_prompts": 1, "repeats": 1, "max_new_tokens": 50})
    assert COLUMNS in table


def test_an_efficiency_over_100_percent_is_flagged_unstable():
    """t(1) measured during a slow spell makes the bound too low: 147% was printed; now 'unstable'."""
    costs = {1: 1e-3, 4: 1.5e-3}
    vanilla = _method("vanilla", [(50, 0.05)])
    spec = _method("spec", [(50, 0.05 / 1.47 * 0.75)], tau=2.0, n_verify=4.0)  # steps shorter than t(4)
    rows = summarise([vanilla, spec], costs)
    assert rows[1]["efficiency"] == pytest.approx(1.47) and rows[1]["timings_unstable"]
    assert not rows[0]["timings_unstable"]
    table = markdown(rows, costs, {"target": "t", "hardware": "cpu", "dtype": "float32", "num_prompts": 1,
                                   "repeats": 1, "max_new_tokens": 50})
    assert "147%" not in table and "| unstable |" in table and UNSTABLE in table
