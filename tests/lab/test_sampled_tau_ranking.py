"""lab/sampled_tau_ranking.py: training's decode τ at T = 1, remade from the run's config, is the number the run
logged (a run trained with train.eval_temperature=[0,1]); beside it real τ at T = 1 and their rank correlation."""
from __future__ import annotations

import json

from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.lab import sampled_tau_ranking
from draftsmith.train.run import setup


def test_the_remade_decode_tau_is_the_logged_one(tiny_files, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "train.max_steps=6", "train.eval_every=3", "train.save_every=3",
                      "train.eval_temperature=[0,1]"))
    report = tmp_path / "gate.json"
    heads = [str(out / "checkpoints" / "step-0000003"), str(out)]
    assert sampled_tau_ranking.main([*heads, "--prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", "8",
                                     "--out", str(report)]) == 0
    found = json.loads(report.read_text())
    logged = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tau" in r}
    for row in found["rows"]:
        assert row["decode_tau_t1"] == logged[row["step"]]["decode_tau_t1"]
        assert row["greedy_decode_tau"] == logged[row["step"]]["decode_tau"]
        assert row["real_tau_t1"] >= 1
    again = tmp_path / "again.json"  # real τ taken from the first report: the same rows
    assert sampled_tau_ranking.main([*heads, "--real-from", str(report), "--out", str(again)]) == 0
    def timeless(rows):
        return [{k: v for k, v in r.items() if k != "decode_seconds_t1"} for r in rows]

    assert timeless(json.loads(again.read_text())["rows"]) == timeless(found["rows"])
