"""lab/bench_batch_plan.py on a tiny target and an untrained EAGLE-3 head: every method decodes every batch of every
size, the fixed lengths through their plans, and the report names the best fixed length and the default's ratio to
it (values not checked: tests never time)."""
from __future__ import annotations

import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer.bench.batch import left_pad
from draftsmith.infer.drafters import AdaptiveLength, ByTemperature, CostAwareLength
from draftsmith.lab.bench_batch_plan import decoders, measure, summary


def test_every_method_decodes_every_batch_and_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    target = make_tiny_target("llama", dtype=torch.float32)
    torch.manual_seed(0)
    head = build_head("eagle3", target).eval()
    methods = decoders(target, head, None, [0, 2])
    assert list(methods) == ["default", "adaptive", "chosen", "L0", "L2"]
    assert isinstance(methods["adaptive"][0].drafter, AdaptiveLength)
    assert isinstance(methods["default"][0].drafter, ByTemperature) and methods["default"][1] is None
    assert isinstance(methods["chosen"][0].drafter, CostAwareLength)
    assert methods["L0"][0] is methods["L2"][0] and methods["L2"][1].lengths == {1: 2}
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    batches = {b: [left_pad(prompts[i: i + b], 0, torch.device("cpu")) for i in range(0, 4, b)] for b in (1, 2)}
    totals = measure(methods, batches, rounds=1, n=5, temperature=0.0)
    report = summary(totals)
    assert list(report) == ["1", "2"]
    for b, r in report.items():
        assert list(r["methods"]) == list(methods) and r["best_fixed"] in ("L0", "L2")  # fixed lengths only
        assert totals[int(b)]["L0"][1] == 4 * 5 and totals[int(b)]["L0"][2] == 4 // int(b) * 4  # plain: a step a token after the prefill's
        assert r["methods"]["L0"]["tau_per_row"] == 1.0 and r["default_over_best_fixed"] > 0
