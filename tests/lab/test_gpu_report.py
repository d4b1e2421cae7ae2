"""lab/gpu_report.py --smoke end to end on CPU: regenerate, train (the launch command it builds, run in this
process; the lease tests below launch it for real), benchmark,
report; then a second run reuses every cached phase."""
from __future__ import annotations

import json

import pytest
import yaml
from support.targets import make_tiny_target
from fixtures.chat_tokenizers import make_chat_tokenizer

from draftsmith.lab.gpu_report import REPO, main, plan, report_rows


def sharegpt(*pairs, id):
    return {"id": id, "conversations": [{"from": f, "value": v} for f, v in pairs]}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-report")
    tokenizer = make_chat_tokenizer("chatml")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_target("llama", vocab_size=len(tokenizer), eos_token_id=im_end, pad_token_id=0,
                             max_position_embeddings=1024, initializer_range=0.5)
    model.generation_config.eos_token_id = im_end
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    rows = [sharegpt(("human", f"What is {i} plus {i}?"), ("gpt", f"{2 * i}."), id=f"r{i}") for i in range(6)]
    (root / "rows.json").write_text(json.dumps(rows))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                                for q in ("Say hello.", "What is the capital of France?")))
    return root


def train_in_process(monkeypatch) -> list[list[str]]:
    """``gpu_report.train_head``'s ``accelerate launch train/train_head.py ...`` run as ``train_head.cli`` in this
    process (its cwd and log file as the launch's): the command it builds is checked, the launch itself is
    test_lease_smoke_trains_and_decodes_both_heads_on_cpu's (two real launches of the same
    ``accelerate_launch`` prefix and script). Saves a process's imports (~10 s). The commands run are returned."""
    import contextlib
    import subprocess

    from draftsmith.lab import gpu_report
    from draftsmith.train.train_head import cli

    launched, real_run, prefix = [], subprocess.run, gpu_report.accelerate_launch(True)

    def run(cmd, *args, **kwargs):
        if list(cmd[:len(prefix)]) != prefix or cmd[len(prefix)] != str(REPO / "train" / "train_head.py"):
            return real_run(cmd, *args, **kwargs)
        launched.append(list(cmd))
        with monkeypatch.context() as mp, contextlib.redirect_stdout(kwargs["stdout"]), \
                contextlib.redirect_stderr(kwargs["stdout"]):
            mp.chdir(kwargs["cwd"])
            code = cli(list(cmd[len(prefix) + 1:]))
        return subprocess.CompletedProcess(cmd, code)

    monkeypatch.setattr(gpu_report.subprocess, "run", run)
    return launched


def test_smoke_runs_every_phase_and_resumes(inputs, capsys, monkeypatch):
    launched = train_in_process(monkeypatch)
    work, out = inputs / "work", inputs / "report"
    argv = ["--real", "--smoke", "--budget-min", "5", "--target", str(inputs / "target"), "--data", str(inputs / "rows.json"),
            "--train-data", str(inputs / "rows.json"),
            "--prompts", str(inputs / "prompts.jsonl"), "--work", str(work), "--out", str(out), "--device", "cpu",
            "--config", "configs/demo.yaml"]
    result = main(argv)
    assert len(launched) == 1 and "--config" in launched[0]  # the one training, launched as on the device
    status = json.loads((work / "status.json").read_text())
    assert list(status["done"]) == ["assets", "regenerate", "train-eagle3", "bench"]
    assert status["done"]["regenerate"]["rows"] == 4  # plan(smoke).conversations
    trained = yaml.safe_load((work / "eagle3" / "config.yaml").read_text())
    assert trained["data"]["self_distill"]["rows"] == 0  # regenerated once, by its own phase, not again in training
    assert status["done"]["train-eagle3"]["step"] == 2
    assert status["done"]["train-eagle3"]["simulated_tau"] >= 1  # evaluated on the regenerated rows
    regenerated = [json.loads(line) for line in (work / "regenerated.jsonl").read_text().splitlines()]
    assert [r["source_index"] for r in sorted(regenerated, key=lambda r: r["source_index"])] == [0, 1, 2, 3]
    names = [r["method"] for r in result["rows"]]
    assert names[:3] == ["vanilla", "hf-static", "hf-prompt-lookup"]
    assert [n for n in names if n.startswith("eagle3:")] == ["eagle3:tree", "eagle3:chain3", "eagle3:chain5",
                                                              "eagle3:chain7"]
    for row in result["rows"]:
        assert set(row) >= {"method", "tokens_per_s", "tau", "vs_hf_static", "identical"}
        assert row["identical"], row["method"]
        assert row["tokens_per_s"] > 0 and row["tau"] >= 1
    saved = json.loads((out / "results.json").read_text())
    assert saved["device"] and saved["rows"] == result["rows"]
    assert "| eagle3:chain5 |" in (out / "results.md").read_text()
    assert (out / "speedup_tau.png").stat().st_size > 0

    capsys.readouterr()
    main(argv)  # every phase cached: nothing regenerated or trained again
    assert len(launched) == 1
    printed = capsys.readouterr().out
    for name in ("assets", "regenerate", "train-eagle3", "bench"):
        assert f"gpu_report: {name} cached" in printed
    assert len((work / "regenerated.jsonl").read_text().splitlines()) == 4


def test_plan_scales_with_the_budget():
    small, large = plan(15, 1, smoke=False), plan(40, 1, smoke=False)
    assert large.conversations > small.conversations and large.train_minutes > small.train_minutes
    assert large.num_prompts >= small.num_prompts
    two = plan(40, 2, smoke=False)
    assert two.train_minutes < large.train_minutes / 2  # each kind also loads and tokenizes
    for p, budget, kinds in ((small, 15, 1), (large, 40, 1), (two, 40, 2)):
        assert p.regen_minutes + kinds * (p.train_minutes + 2.5) == pytest.approx(0.55 * budget)  # bench: 45%


def test_report_rows_name_heads_by_kind_and_keep_the_columns():
    rows = report_rows([{"method": "eagle3:eagle3:chain5", "tokens_per_s": 10.0, "tau": 3.0,
                         "speedup_vs_hf_static": 2.5, "identical": True, "bound": 4.0},
                        {"method": "hf-static", "tokens_per_s": 4.0, "tau": 1.0, "speedup_vs_hf_static": 1.0,
                         "identical": True, "bound": 1.0}])
    assert [r["method"] for r in rows] == ["eagle3:chain5", "hf-static"]
    assert rows[0]["vs_hf_static"] == 2.5 and rows[0]["bound"] == 4.0 and "speedup_vs_hf_static" not in rows[0]


# ---------------------------------------------------------------- lab/gpu_lease.py: the one-call GPU proof

def lease_main(argv):
    from draftsmith.lab.gpu_lease import main as lease

    return lease(argv)


def planted_rates(tmp_path, **values):
    """The shipped rates file with ``values`` planted (rate name -> seconds)."""
    from draftsmith.lab.gpu_lease import RATES

    data = json.loads(RATES.read_text())
    for name, value in values.items():
        data["rates"][name]["value"] = value
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(data))
    return path


def test_lease_dry_run_fits_nine_minutes_and_64_mib(capsys, tmp_path):
    from draftsmith.lab.gpu_lease import PHASES, RATES, carried_files, estimates, load_rates

    assert lease_main(["--dry-run", "--wheels", str(tmp_path / "none")]) == 0
    printed = capsys.readouterr().out
    rates = load_rates(RATES)
    plan = estimates(rates)
    assert list(plan) == list(PHASES) and sum(plan.values()) <= 540 == rates["budget_s"]
    assert f"plan total {sum(plan.values()):.1f} s of 540 s" in printed
    repo = sum(size for _, size in carried_files(REPO))
    wheels = sum(size for name, size in rates["wheels"].items() if name.endswith(".whl"))
    assert repo + wheels <= 64 * 2 ** 20 and f"carry total {(repo + wheels) / 2 ** 20:.2f} MiB of 64 MiB" in printed
    assert "data/demo_targets/tiny-seed0/model.safetensors" in dict(carried_files(REPO))  # the shipped target travels
    assert "FAIL" not in printed


def test_lease_dry_run_fails_past_the_budget_or_the_carry(capsys, tmp_path):
    slow = planted_rates(tmp_path, hf_static_compile_s=120.0)  # 3 compiles x 74 s more: past 540 s
    assert lease_main(["--dry-run", "--rates", str(slow), "--wheels", str(tmp_path / "none")]) == 1
    assert "FAIL: the plan takes" in capsys.readouterr().out
    wheels = tmp_path / "whl"
    wheels.mkdir()
    with open(wheels / "huge-1.0-py3-none-any.whl", "wb") as f:
        f.truncate(45 * 2 ** 20)  # sparse: 45 MiB beside the ~22 MiB repository
    assert lease_main(["--dry-run", "--wheels", str(wheels)]) == 1
    printed = capsys.readouterr().out
    assert "FAIL: the carry is" in printed and "huge-1.0-py3-none-any.whl" in printed and "on disk" in printed


def test_lease_carry_is_tracked_and_untracked_but_not_ignored(tmp_path):
    import subprocess

    from draftsmith.lab.gpu_lease import carried_files

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("runs/\n")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", ".gitignore", "tracked.py"], check=True)
    (tmp_path / "new.txt").write_text("12345")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "big.bin").write_bytes(b"0" * 1000)
    assert carried_files(tmp_path) == [(".gitignore", 6), ("new.txt", 5), ("tracked.py", 6)]


def test_lease_rates_need_a_value_and_a_source(tmp_path):
    from draftsmith.lab.gpu_lease import RATES, load_rates

    data = json.loads(RATES.read_text())
    data["rates"]["probe_s"].pop("source")
    path = tmp_path / "rates.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"rates\.probe_s \(used by phase probe\) needs a numeric 'value' and a 'source'"):
        load_rates(path)


def test_lease_skips_a_phase_that_would_overrun_and_records_a_failing_one(tmp_path, monkeypatch, capsys):
    from draftsmith.lab import lease_phases

    out = tmp_path / "out"
    # probe is estimated at 17 s x SMOKE_SCALE = 0.017 s: a budget of 0.001 s skips it, and the folder is still written
    assert lease_main(["--smoke", "--device", "cpu", "--out", str(out), "--budget-s", "0.001", "--phases", "probe"]) == 0
    saved = json.loads((out / "results.json").read_text())
    assert saved["phases"] == {} and "needs ~0.0 s by the rates" in saved["skipped"]["probe"]
    assert "probe: skipped" in (out / "summary.md").read_text()

    def broken(lease):
        raise RuntimeError("planted")

    monkeypatch.setitem(lease_phases.PHASES, "probe", broken)
    out2 = tmp_path / "out2"
    assert lease_main(["--smoke", "--device", "cpu", "--out", str(out2), "--phases", "probe,shape-qwen3-8b"]) == 1
    saved = json.loads((out2 / "results.json").read_text())
    assert saved["phases"]["probe"]["error"] == "RuntimeError: planted"
    qwen = saved["phases"]["shape-qwen3-8b"]  # the next phase ran (it measures the copy rate itself)
    assert "error" not in qwen and set(qwen["t_over_t1"]) == {"1", "2", "4"} and qwen["hbm_bound_ms"] > 0


def smoke(tmp_path, phases: list[str]) -> tuple[dict, object]:
    """``--smoke --device cpu`` over ``phases``: the saved results (every phase ran, none failed) and the folder."""
    out = tmp_path / "lease"
    assert lease_main(["--smoke", "--device", "cpu", "--out", str(out), "--phases", ",".join(phases)]) == 0
    saved = json.loads((out / "results.json").read_text())
    assert list(saved["phases"]) == phases and saved["skipped"] == {}
    for name, phase in saved["phases"].items():
        assert "error" not in phase, (name, phase.get("traceback"))
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.stat().st_size < 16 * 2 ** 20 for p in files)
    return saved, out


def test_lease_smoke_runs_the_speed_phases_on_cpu(tmp_path):
    """Every phase but the trained heads at tiny shapes on the CPU: the code the GPU runs, at a smoke test's sizes."""
    saved, out = smoke(tmp_path, ["probe", "shape-llama3.1-8b", "shape-qwen3-8b", "batch", "hybrid"])
    llama = saved["phases"]["shape-llama3.1-8b"]
    rows = llama["rows"]
    assert set(rows) == {"hf-static", "ours:oracle-tau5", "ours:oracle-tau3"}
    assert rows["ours:oracle-tau5"]["tau"] > rows["ours:oracle-tau3"]["tau"] > 1  # two acceptances, one verify size
    assert rows["ours:oracle-tau5"]["budget"] == rows["ours:oracle-tau3"]["budget"] == 5
    assert set(llama["head_draft_ms"]) == {"eagle3", "dflash"} and all(
        v > 0 for costs in llama["head_draft_ms"].values() for v in costs.values())
    assert llama["t_over_t1"]["1"] == 1.0 and llama["t1_over_hbm_bound"] > 0
    batch = saved["phases"]["batch"]["rows"]
    assert [(r["batch_size"], r["method"]) for r in batch] == [
        (2, "hf-static"), (2, "ours:oracle-tau5-eager"), (3, "hf-static"), (3, "ours:oracle-tau5-eager")]
    assert all(r["identical"] for r in batch)  # fp32 on the CPU: every row equals HF's batched static greedy
    hybrid = saved["phases"]["hybrid"]
    assert hybrid["identical_to_hf"] and 1 < hybrid["tau"] < 5
    assert hybrid["rollback"] == "recorded"  # on the CPU: every position's states kept, nothing verified twice
    assert hybrid["pending_tokens"] == hybrid["reverify_share"] == 0
    assert 0 <= hybrid["rollback_share"] < 1 and set(hybrid["t_over_t1"]) == {"1", "2", "4"}
    summary = (out / "summary.md").read_text()
    assert len(summary.splitlines()) <= 40 and "P8 bs 3" in summary and "P1/P2 ours:oracle-tau3" in summary


@pytest.mark.slow
def test_lease_smoke_trains_and_decodes_both_heads_on_cpu(tmp_path):
    """The heads phase: two real training launches side by side, the gpu-marked tests beside them, the decode."""
    saved, out = smoke(tmp_path, ["heads"])
    heads = saved["phases"]["heads"]
    assert {k: v["exit"] for k, v in heads["train"].items()} == {"eagle3": 0, "dflash": 0}
    assert heads["tests"]["exit"] == 0 and "skipped" in heads["tests"]["last_line"]  # -m gpu: skipped without CUDA
    assert set(heads["decode"]) == {"vanilla", "eagle3", "dflash"}
    assert all(row["identical"] for row in heads["decode"].values())
    assert heads["winner_at_equal_training_time"] in ("eagle3", "dflash")
    assert {p.name for p in out.iterdir()} >= {"results.json", "summary.md", "tests.txt", "train-eagle3.log",
                                               "train-dflash.log"}
    assert "P6 eagle3" in (out / "summary.md").read_text()


def test_lease_docs_give_the_one_call_and_the_wheels_the_dry_run_counts():
    """docs/benchmarks.md's call fits the device tool (2,000 characters) and runs this script; the wheels it tells
    to download are the ones the dry run counts."""
    import re

    from draftsmith.lab.gpu_lease import RATES

    text = (REPO / "docs" / "benchmarks.md").read_text()
    section = text[text.index("### GPU: one command, `lab/gpu_lease.py`"):]
    call = re.search(r"\*\*The call\*\*.*?```bash\n(.*?)\n```", section, re.S).group(1)
    assert len(call) <= 2000 and f"; {len(call)} characters)" in section
    assert "lab/gpu_lease.py --out $OUT/lease" in call and ".whl/*.whl" in call and "HF_HUB_OFFLINE=1" in call
    download = re.search(r"-d \.whl (.*)\n", section).group(1).split()
    wheels = [name for name in json.loads(RATES.read_text())["wheels"] if name.endswith(".whl")]
    assert sorted(d.split("==")[0].replace("-", "_") + "-" + d.split("==")[1] for d in download) == sorted(
        "-".join(w.split("-")[:2]) for w in wheels)


def test_lease_dry_run_plans_only_the_phases_asked_for(capsys, tmp_path):
    """`--dry-run --phases probe` planned all six phases, and with --budget-s 100 failed on the ones it was
    told not to run; `--phases ,` was taken (and ran nothing)."""
    from draftsmith.lab.gpu_lease import RATES, estimates, load_rates

    probe = estimates(load_rates(RATES))["probe"]
    assert lease_main(["--dry-run", "--phases", "probe", "--budget-s", "100", "--wheels", str(tmp_path / "none")]) == 0
    printed = capsys.readouterr().out
    assert f"plan total {probe:.1f} s of 100 s" in printed and "FAIL" not in printed
    assert "  probe " in printed and "shape-llama3.1-8b" not in printed and "build_8b_s" not in printed
    for phases, message in ((",", "--phases ',' names no phase"), (" ", "names no phase"),
                            ("probe,batch,probe", "--phases names probe twice")):
        with pytest.raises(SystemExit):
            lease_main(["--dry-run", "--phases", phases])
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
