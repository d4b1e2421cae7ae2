"""scripts/acceptance_curve.py on a tiny budget: every recipe trains, continues on-policy, is measured (in a
second phase that finds the heads in results.json), and the table, the plot and results.json say so (the demo
target itself is never built here)."""
from __future__ import annotations

import json

import pytest
import yaml
from test_train_fixtures import MAX_LENGTH, tiny_files  # noqa: F401  (fixture)

from draftsmith.scripts import acceptance_curve


def test_the_curve_trains_measures_and_writes_its_table(tiny_files, tmp_path):  # noqa: F811
    data = {"train": str(tiny_files["train"]), "eval": str(tiny_files["eval"]), "max_length": MAX_LENGTH,
            "eval_rows": 4}
    configs = {}
    for kind, head in (("eagle3", {"kind": "eagle3", "ttt_steps": 2}), ("dflash", {"kind": "dflash"})):
        configs[kind] = tmp_path / f"{kind}.yaml"
        configs[kind].write_text(yaml.safe_dump({"head": head, "data": data, "train": {
            "micro_batch_size": 4, "lr": 3e-3, "log_every": 1}}))
    recipes = {"eagle3": (str(configs["eagle3"]), []),
               "dflash-new": (str(configs["dflash"]), ["head.block_size=5", "head.num_layers=1",  # the CPU chain of 4
                                                        "train.loss=dpace"])}  # its on-policy stage trains with its own loss
    args = acceptance_curve.parse_args([
        "--budgets", "2", "--recipes", "eagle3,dflash-new", "--on-policy-steps", "1", "--target",
        str(tiny_files["target"]), "--max-new-tokens", "8", "--rounds", "1", "--runs", str(tmp_path / "runs"),
        "--out", str(tmp_path / "out"), "--set", "data.self_distill.rows=0", f"cache_dir={tmp_path / 'cache'}"])
    args.phase = "train"  # first only train (what a busy machine does), then measure what results.json lists
    trained = acceptance_curve.run_curve(args, recipes)
    assert not any("tau" in r for r in trained) and not (tmp_path / "out" / "curve.md").exists()
    args.phase = "all"  # nothing is trained twice: every row is found in results.json and only measured
    rows = acceptance_curve.run_curve(args, recipes)
    assert [(r["head"], r["train_minutes"]) for r in rows] == [(r["head"], r["train_minutes"]) for r in trained]
    assert [(r["recipe"], r["steps"]) for r in rows] == [("eagle3", 2), ("eagle3+opd", 1), ("dflash-new", 2),
                                                          ("dflash-new+opd", 1)]
    assert all(r["identical"] and r["tau"] >= 1 and r["speedup"] > 0 and r["simulated_tau"] >= 1 for r in rows), rows
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == rows
    # the on-policy stage continues at a fraction of the recipe's lr (the recipe's own undid a trained head):
    # a hundredth for EAGLE-3, a tenth for DFlash
    for row in rows:
        lr = yaml.safe_load((tmp_path / "runs" / f"{row['recipe']}-2" / "config.yaml").read_text())["train"]["lr"]
        stage = {"eagle3+opd": 3e-5, "dflash-new+opd": 3e-4}.get(row["recipe"], 3e-3)
        assert lr == pytest.approx(stage), (row["recipe"], lr)
    table = (tmp_path / "out" / "curve.md").read_text()
    assert "--budgets 2 --recipes eagle3,dflash-new --on-policy-steps 1" in table and table.count("| yes |") == 4
    assert (tmp_path / "out" / "curve.png").stat().st_size > 1000


def test_bad_options_are_usage_errors():
    for argv, message in ((["--budgets", "3,x"], "--budgets"), (["--recipes", "medusa"], "unknown 'medusa'"),
                          (["--on-policy-steps", "-1"], "--on-policy-steps must be >= 0")):
        with pytest.raises(SystemExit) as err:
            acceptance_curve.parse_args(argv)
        assert err.value.code == 2, message
