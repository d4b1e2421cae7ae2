"""lab/bench_heads.py on a tiny target and two untrained EAGLE-3 heads: every head and HF's generate decode every
prompt at each temperature, and the report has each one's tokens/s, its speed over hf (hf's is 1) and each head's τ
(values not checked: tests never time)."""
from __future__ import annotations

import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.lab.bench_heads import measure, summary


def test_every_head_decodes_every_prompt_and_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    target = make_tiny_target("llama", dtype=torch.float32)
    gens = {}
    for seed in (0, 1):
        torch.manual_seed(seed)
        gens[f"h{seed}"] = SpeculativeGenerator(target, build_head("eagle3", target).eval())
    prompts = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[9, 10]])]
    with torch.inference_mode():
        totals = measure(target, gens, prompts, [0.0, 0.8], rounds=1, n=6)
    assert all(totals[t][m][1] == 2 * 6 for t in totals for m in totals[t])  # every prompt, every token
    report = summary(totals)
    assert list(report) == ["0", "0.8"]
    for rows in report.values():
        assert list(rows) == ["hf", "h0", "h1"] and rows["hf"]["speed_over_hf"] == 1.0 and "tau" not in rows["hf"]
        assert all(rows[h]["tau"] >= 1 and rows[h]["tokens_per_s"] > 0 for h in ("h0", "h1"))
