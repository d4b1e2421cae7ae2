"""lab/bench_dspark_cut.py on a tiny target and an untrained DSpark head: every method decodes every prompt at each
temperature and the report has each method's tokens/s, its speed over "every" and τ (values not checked: tests never
time)."""
from __future__ import annotations

import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer.drafters import CostAwareLength
from draftsmith.infer.drafters.variants.dspark import DSparkDrafter
from draftsmith.lab.bench_dspark_cut import measure, methods


def test_every_method_decodes_and_is_reported():
    target = make_tiny_target("llama", dtype=torch.float32)
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=4, num_layers=1, markov_rank=8, variant="dspark").eval()
    decoders = methods(target, head)
    assert list(decoders) == ["every", "threshold", "chooser", "chooser-every"]
    assert decoders["every"].drafter.threshold == 0.0 and decoders["threshold"].drafter.threshold == 0.5
    chooser = decoders["chooser"].drafter
    assert isinstance(chooser, CostAwareLength) and isinstance(chooser.drafter, DSparkDrafter)
    assert chooser.drafter.by_cost and not decoders["chooser-every"].drafter.drafter.by_cost
    report = measure(target, head, [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]])], [0.0, 0.8], n=6)
    assert list(report) == ["0.0", "0.8"]
    for rows in report.values():
        assert list(rows) == list(decoders) and rows["every"]["speed_over_every"] == 1.0
        assert all(r["tokens_per_s"] > 0 and r["tau"] >= 1 and r["range"][0] <= r["median_over_every"] <= r["range"][1]
                   for r in rows.values())
