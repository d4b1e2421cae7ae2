"""scripts/gpu_report.py --smoke end to end on CPU: regenerate, train (a real accelerate launch), benchmark,
report; then a second run reuses every cached phase."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import make_tiny_target
from fixtures.chat_tokenizers import make_chat_tokenizer

from draftsmith.scripts.gpu_report import main, plan, report_rows


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


def test_smoke_runs_every_phase_and_resumes(inputs, capsys):
    work, out = inputs / "work", inputs / "report"
    argv = ["--real", "--smoke", "--budget-min", "5", "--target", str(inputs / "target"), "--data", str(inputs / "rows.json"),
            "--train-data", str(inputs / "rows.json"),
            "--prompts", str(inputs / "prompts.jsonl"), "--work", str(work), "--out", str(out), "--device", "cpu",
            "--config", "configs/demo.yaml"]
    result = main(argv)
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
