"""scripts/benchmark.py end to end on a tiny saved target: every method measured, files written."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import make_tiny_target
from data.tokenizer import train_tokenizer
from heads import build_head

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    target = make_tiny_target("llama", vocab_size=len(tokenizer), num_layers=6)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    heads = []
    for kind in ("medusa", "eagle3"):
        build_head(kind, target).save_pretrained(root / kind)
        heads.append(str(root / kind))
    assistant = make_tiny_target("llama", vocab_size=len(tokenizer), num_layers=1, seed=1)
    assistant.save_pretrained(root / "assistant")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def add(a,", "for i in")) + "\n")
    return root, heads, prompts


def test_benchmark_measures_every_method(bench_dirs):
    root, heads, prompts = bench_dirs
    out = root / "out"
    result = _load_script().main([
        "--target", str(root / "target"), "--heads", *heads, "--assistant", str(root / "assistant"),
        "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--ignore-eos",
        "--repeats", "1", "--warmup", "0", "--tree-sizes", "1,4,8", "--profile", "--out", str(out),
        "--trees", "tree,chain2,dyn3-2-5,medusa4", "--adaptive",
    ])
    names = [r["method"] for r in result["rows"]]
    assert names[:8] == ["vanilla", "hf-assisted", "draft-lm:chain4", "draft-lm:adaptive", "hf-prompt-lookup",
                         "ngram:chain", "ngram:tree3", "ngram:adaptive"]
    # each head gets the trees that fit its kind: no dynamic tree for Medusa, no static one for EAGLE-3
    assert names[8:] == ["medusa:medusa:tree", "medusa:medusa:chain2", "medusa:medusa:medusa4", "medusa:medusa:adaptive",
                         "eagle3:eagle3:tree", "eagle3:eagle3:chain2", "eagle3:eagle3:dyn3-2-5", "eagle3:eagle3:adaptive"]
    vanilla = result["rows"][0]
    assert vanilla["speedup"] == pytest.approx(1.0) and vanilla["tau"] == pytest.approx(1.0)
    assert vanilla["bound"] == pytest.approx(1.0)
    for row in result["rows"]:
        assert row["identical"], f"{row['method']} changed the greedy output"
        assert row["tokens_per_s"] > 0 and row["bound"] > 0
    for runs in result["runs"].values():
        assert all(r["new_tokens"] == 8 for r in runs)
    for name in ("results.json", "results.md", "speedup_tau.png", "verification_cost.png", "profile.png"):
        assert (out / name).stat().st_size > 0
    assert "| vanilla |" in (out / "results.md").read_text()

    # --profile: one phase breakdown per head method; the phases add up to the step
    profiles = result["profile"]
    assert list(profiles) == [n for n in names if n not in ("vanilla", "hf-assisted", "hf-prompt-lookup")]
    for name, prof in profiles.items():
        phases = prof["ms_per_step"]
        assert set(phases) == {"draft", "observe", "verify", "accept", "compact", "emit"}
        assert phases["draft"] > 0 and phases["verify"] > 0 and min(phases.values()) >= 0
        assert prof["step_ms"] == pytest.approx(sum(phases.values()))
        assert 1.0 <= prof["tokens_per_step"] and 0 < prof["drafting_share"] < 1
    assert "Where a step's time goes" in (out / "results.md").read_text()


def test_prompt_file_rows_must_have_prompt_or_messages(bench_dirs, tmp_path):
    root, heads, _ = bench_dirs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"question": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a prompt row needs 'prompt' or 'messages'"):
        _load_script().main(["--target", str(root / "target"), "--prompts", str(bad), "--out", str(tmp_path / "o")])


def test_unknown_tree_spec_is_refused(bench_dirs, tmp_path, capsys):
    root, heads, prompts = bench_dirs
    with pytest.raises(SystemExit):
        _load_script().main(["--target", str(root / "target"), "--heads", *heads, "--trees", "tree,dyn3-2",
                             "--out", str(tmp_path / "o")])
    assert "unknown tree(s) ['dyn3-2']" in capsys.readouterr().err


def test_draft_calibration_counts_every_draft():
    spec = importlib.util.spec_from_file_location("calibration_script", ROOT / "scripts" / "draft_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = make_tiny_target("llama", num_layers=6)
    target.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    result = module.calibration(target, build_head("eagle3", target).eval(), prompts, max_new_tokens=12)
    # one draft per verification step, except a last step with one token left (no room for a draft)
    assert result["steps"] - len(prompts) <= result["drafts"] <= result["steps"] and result["steps"] >= 12
    assert 0 < result["draft_top1_prob"] <= 1
    assert 0 <= result["accepted"] <= 1 and 0 < result["target_top1_prob"] <= 1
    with pytest.raises(ValueError, match="EAGLE head"):
        module.calibration(target, build_head("medusa", target), prompts, max_new_tokens=4)
