"""lab/bench_sampled.py on a tiny target and an untrained head: every method decodes the asked tokens at each
temperature and the report has each method's least time and ratios to HF's (values not checked: tests never time)."""
from __future__ import annotations

import json

import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer import SpeculativeGenerator
from draftsmith.lab.bench_sampled import emit, measure, methods


def test_every_method_decodes_and_is_reported_at_every_temperature(tmp_path, capsys):
    target = make_tiny_target("llama", dtype=torch.float32)
    torch.manual_seed(0)
    gen = SpeculativeGenerator(target, build_head("eagle3", target))
    names = ["hf", "default", "default-modules", "plain", "plain-modules", "chain1"]
    decoders = methods(gen)
    assert list(decoders) == names
    assert [d.lean for d in list(decoders.values())[1:]] == [True, False, True, False, True]
    report = measure(gen, [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]])], [0.0, 0.8], rounds=2, n=6)
    assert list(report) == ["0.0", "0.8"]
    for rows in report.values():
        assert list(rows) == names and rows["hf"]["speed_over_hf_least"] == 1.0
        assert rows["hf"]["speed_over_hf_total"] == 1.0
        assert all(r["ms_per_token_least"] > 0 and r["range"][0] <= r["speed_over_hf_median"] <= r["range"][1]
                   for r in rows.values())
    emit(report, str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(capsys.readouterr().out) == report
