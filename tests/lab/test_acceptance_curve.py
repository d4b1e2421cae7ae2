"""lab/acceptance_curve.py on a tiny budget: every recipe trains, continues on-policy, is measured (in a
second phase that finds the heads in results.json), and the table, the plot and results.json say so (the demo
target itself is never built here)."""
from __future__ import annotations

import json

import pytest
import yaml
from support.train_fixtures import MAX_LENGTH, tiny_files  # noqa: F401  (fixture)

from draftsmith.lab import acceptance_curve


def test_the_curve_trains_measures_and_writes_its_table(tiny_files, tmp_path):  # noqa: F811
    data = {"train": str(tiny_files["train"]), "eval": str(tiny_files["eval"]), "max_length": MAX_LENGTH,
            "eval_rows": 4}
    configs = {}
    for kind, head in (("eagle3", {"kind": "eagle3", "ttt_steps": 2}), ("dflash", {"kind": "dflash"})):
        configs[kind] = tmp_path / f"{kind}.yaml"
        configs[kind].write_text(yaml.safe_dump({"head": head, "data": data, "train": {
            "micro_batch_size": 4, "lr": 3e-3, "log_every": 1,
            "eval_decode_rows": 2, "eval_decode_tokens": 8}}))  # decode tau at each run's end, on a tiny share
    recipes = {"eagle3": (str(configs["eagle3"]), []),
               "dflash-new": (str(configs["dflash"]), ["head.block_size=5", "head.num_layers=1",  # the CPU chain of 4
                                                        "train.loss=dpace"])}  # its on-policy stage trains with its own loss
    args = acceptance_curve.parse_args([
        "--budgets", "2", "--recipes", "eagle3,dflash-new", "--on-policy-steps", "1", "--target",
        str(tiny_files["target"]), "--max-new-tokens", "8", "--rounds", "1", "--runs", str(tmp_path / "runs"),
        "--out", str(tmp_path / "out"), "--temperatures", "0,1", "--set", "data.self_distill.rows=0", f"cache_dir={tmp_path / 'cache'}"])
    args.phase = "train"  # first only train (what a busy machine does), then measure what results.json lists
    trained = acceptance_curve.run_curve(args, recipes)
    assert not any("tau" in r for r in trained) and not (tmp_path / "out" / "curve.md").exists()
    args.phase = "all"  # nothing is trained twice: every row is found in results.json and only measured
    rows = acceptance_curve.run_curve(args, recipes)
    assert [(r["head"], r["train_minutes"]) for r in rows] == [(r["head"], r["train_minutes"]) for r in trained]
    assert [(r["recipe"], r["steps"]) for r in rows] == [("eagle3", 2), ("eagle3+opd", 1), ("eagle3+sup", 1),
                                                          ("dflash-new", 2), ("dflash-new+opd", 1), ("dflash-new+sup", 1)]
    assert all(r["identical"] and r["tau"] >= 1 and r["speedup"] > 0 and r["simulated_tau"] >= 1 for r in rows), rows
    # and sampled, at T = 1 (--temperatures 0,1): τ, tokens/s, speedup and vLLM's mean acceptance length
    assert all(r["measured_at"] == [0.0, 1.0] and r["tau_t1"] >= 1 and r["tokens_per_s_t1"] > 0 and r["speedup_t1"] > 0
               and r["mean_acceptance_length_t1"] >= 1 for r in rows), rows
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == rows
    # the on-policy stage continues at a fraction of the recipe's lr (the recipe's own undid a trained head):
    # a hundredth for EAGLE-3, a tenth for DFlash
    for row in rows:
        lr = yaml.safe_load((tmp_path / "runs" / f"{row['recipe']}-2" / "config.yaml").read_text())["train"]["lr"]
        stage = {"eagle3": 3e-5, "dflash-new": 3e-4}[row["recipe"][:-4]] if "+" in row["recipe"] else 3e-3
        assert lr == pytest.approx(stage), (row["recipe"], lr)
    # the control: the stage's steps, loss, lr and start, without the rollout
    for name in ("eagle3", "dflash-new"):
        stage, control = (yaml.safe_load((tmp_path / "runs" / f"{name}{s}-2" / "config.yaml").read_text())["train"]
                          for s in ("+opd", "+sup"))
        assert (stage["stage"], control["stage"]) == ("on-policy", "supervised") and control["loss"] == "ce"
        assert {k: v for k, v in stage.items() if k != "stage"} == {k: v for k, v in control.items() if k != "stage"} \
            or name == "eagle3"  # EAGLE-3's control does not take the stage's chain roots (anchors)
        assert control["init_from"] == stage["init_from"] and control["max_steps"] == stage["max_steps"] == 1
    table = (tmp_path / "out" / "curve.md").read_text()
    assert "--budgets 2 --recipes eagle3,dflash-new --on-policy-steps 1" in table and table.count("| yes |") == 6
    assert "--temperatures 0,1" in table and "| real τ T=1 | tokens/s T=1 | speedup T=1 |" in table
    assert (tmp_path / "out" / "curve.png").stat().st_size > 1000


def test_bad_options_are_usage_errors():
    for argv, message in ((["--budgets", "3,x"], "--budgets"), (["--recipes", "medusa"], "unknown 'medusa'"),
                          (["--on-policy-steps", "-1"], "argument --on-policy-steps: a whole number >= 0")):
        with pytest.raises(SystemExit) as err:
            acceptance_curve.parse_args(argv)
        assert err.value.code == 2, message


def _fake_curve(monkeypatch, tmp_path):
    """run_curve with training and measuring replaced by records of what was asked (no model anywhere)."""
    calls = []

    class Result:
        steps, metrics = 4, {"tau": 2.0}

        def __init__(self, overrides):
            self.output_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))

    monkeypatch.setattr(acceptance_curve, "train", lambda config, overrides: calls.append(overrides) or Result(overrides))
    monkeypatch.setattr(acceptance_curve, "recipe_kind_lr", lambda config, overrides: ("dflash", 1e-4))
    monkeypatch.setattr(acceptance_curve, "measure", lambda *a: {"tau": 2.5, "speedup": 1.1, "identical": True,
                                                                "measured_at": [0.0]})
    monkeypatch.setattr(acceptance_curve, "plot", lambda rows, path: None)
    recipes = {"r": ("c.yaml", [])}
    return calls, lambda *argv: acceptance_curve.run_curve(acceptance_curve.parse_args(
        ["--budgets", "4", "--recipes", "dflash-new", "--out", str(tmp_path / "out"), *argv]), {"dflash-new": recipes["r"]})


def test_rows_name_their_commit_and_settings_and_are_reused_only_when_both_match(monkeypatch, tmp_path):
    calls, curve = _fake_curve(monkeypatch, tmp_path)
    monkeypatch.setattr(acceptance_curve, "code_revision", lambda: "a" * 40)
    rows = curve()
    assert len(calls) == 3 and [r["recipe"] for r in rows] == ["dflash-new", "dflash-new+opd", "dflash-new+sup"]
    assert all(r["commit"] == "a" * 40 and r["settings"]["config"] == "c.yaml" for r in rows)
    assert "train.stage=on-policy" in rows[1]["settings"]["overrides"]
    assert "train.stage=on-policy" not in rows[2]["settings"]["overrides"]
    assert curve() == rows and len(calls) == 3  # same revision, same settings: reused
    curve("--set", "train.lr=1e-3")  # another setting: every row redone, none kept twice
    assert len(calls) == 6
    monkeypatch.setattr(acceptance_curve, "code_revision", lambda: "b" * 40)
    rows = curve("--set", "train.lr=1e-3")  # another revision: redone
    assert len(calls) == 9 and len(rows) == 3 and {r["commit"] for r in rows} == {"b" * 40}
    rows = curve("--set", "train.lr=1e-3", "--prompt", "def f():")  # a measuring setting counts too
    assert len(calls) == 12 and {r["settings"]["prompt"] for r in rows} == {"def f():"}


def test_the_revision_is_this_clone_s_head():
    import subprocess

    head = subprocess.run(["git", "-C", str(acceptance_curve.ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert acceptance_curve.code_revision() == head and len(head) == 40


def test_an_out_folder_holding_another_results_json_is_refused_untouched(tmp_path, capsys):
    from draftsmith.data.entry_point import run

    out = tmp_path / "out"
    out.mkdir()
    for text in ('{"accuracy": 0.5}', '[{"name": "x"}]', "not json"):
        (out / "results.json").write_text(text)
        assert run(acceptance_curve.main, ["--budgets", "1", "--out", str(out)]) == 2
        assert "results.json" in capsys.readouterr().err and (out / "results.json").read_text() == text


@pytest.mark.parametrize("recipe, kind, extra", [("peagle", "eagle3", ("num_depths", 8)),
                                                 ("domino", "dflash", ("gru_hidden_dim", 64))])
def test_the_supervised_only_recipes_load_and_train_no_on_policy_stage(tmp_path, recipe, kind, extra):
    """P-EAGLE and Domino refuse the on-policy stage: their recipes are one training run per budget, whose config
    loads."""
    from draftsmith.train.config import load_config

    args = acceptance_curve.parse_args(["--recipes", recipe, "--runs", str(tmp_path / "runs")])
    (label, config, overrides), = acceptance_curve.stages(args, 40, recipe, acceptance_curve.RECIPES)
    cfg = load_config(acceptance_curve.ROOT / config, [o for o in overrides if not o.startswith("target=")])
    assert (label, cfg.head.kind, cfg.head.variant, getattr(cfg.head, extra[0])) == (recipe, kind, recipe, extra[1])


def test_the_dspark_recipe_loads_and_both_supervised_only_recipes_train_one_row_each(tiny_files, tmp_path):  # noqa: F811
    """DSpark's recipe is the new DFlash recipe with head.variant=dspark; DSpark and P-EAGLE refuse the on-policy
    stage, so each trains one run per budget: their real overrides train two steps on the tiny target."""
    from draftsmith.train.config import load_config

    args = acceptance_curve.parse_args(["--recipes", "dspark", "--runs", str(tmp_path / "runs")])
    (label, config, overrides), = acceptance_curve.stages(args, 40, "dspark", acceptance_curve.RECIPES)
    cfg = load_config(acceptance_curve.ROOT / config, [o for o in overrides if not o.startswith("target=")])
    assert (label, cfg.head.kind, cfg.head.variant, cfg.head.block_size, cfg.head.num_layers, cfg.train.gamma) == (
        "dspark", "dflash", "dspark", 16, 5, None)
    data = {"train": str(tiny_files["train"]), "eval": str(tiny_files["eval"]), "max_length": MAX_LENGTH,
            "eval_rows": 4}
    recipes = {}
    for name, head in (("peagle", {"kind": "eagle3"}), ("dspark", {"kind": "dflash"})):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"head": head, "data": data, "train": {
            "micro_batch_size": 4, "lr": 3e-3, "eval_decode_rows": 2, "eval_decode_tokens": 8}}))
        recipes[name] = (str(path), acceptance_curve.RECIPES[name][1])  # the recipe's own overrides
    args = acceptance_curve.parse_args([
        "--budgets", "2", "--recipes", "peagle,dspark", "--target", str(tiny_files["target"]), "--phase", "train",
        "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--temperatures", "0,1", "--set", "data.self_distill.rows=0",
        f"cache_dir={tmp_path / 'cache'}"])
    rows = acceptance_curve.run_curve(args, recipes)
    assert [(r["recipe"], r["steps"]) for r in rows] == [("peagle", 2), ("dspark", 2)]
    assert all(r["simulated_tau"] >= 1 for r in rows), rows
    heads = {r["recipe"]: yaml.safe_load((tmp_path / "runs" / f"{r['recipe']}-2" / "config.yaml").read_text())["head"]
             for r in rows}
    assert (heads["peagle"]["variant"], heads["peagle"]["norm_output"]) == ("peagle", False)
    assert (heads["dspark"]["variant"], heads["dspark"]["block_size"]) == ("dspark", 16)
