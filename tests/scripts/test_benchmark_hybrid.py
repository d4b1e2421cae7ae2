"""scripts/benchmark.py on a tiny saved hybrid (Qwen3.5): every chain method runs and matches vanilla; HF's
assisted generation and prompt lookup (which refuse stateful models) and trees are skipped, each with
its one-line reason in the report, instead of crashing the run."""
from __future__ import annotations

import json

import pytest
from support.targets import make_tiny_target
from support.hybrids import make_tiny_hybrid
from support.benchmark import load_script

from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.heads import build_head


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-hybrid")
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    target = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer))
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    for kind in ("eagle3", "dflash"):
        build_head(kind, target).save_pretrained(root / kind)
    # a Llama assistant, as demo:assistant is (a hybrid draft LM under HierarchicalDrafter is not yet supported)
    make_tiny_target("llama", vocab_size=len(tokenizer), num_layers=1, seed=1).save_pretrained(root / "assistant")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def add(a,", "for i in")) + "\n")
    return root, prompts


def test_benchmark_on_a_hybrid_skips_what_cannot_run_and_says_why(hybrid_dirs):
    root, prompts = hybrid_dirs
    out = root / "out"
    result = load_script().main([
        "--target", str(root / "target"), "--heads", str(root / "eagle3"), str(root / "dflash"),
        "--assistant", str(root / "assistant"), "--prompts", str(prompts), "--num-prompts", "2",
        "--max-new-tokens", "8", "--ignore-eos", "--repeats", "1", "--warmup", "0", "--tree-sizes", "1,4",
        "--trees", "tree,chain2", "--profile", "--out", str(out),
    ])
    names = [r["method"] for r in result["rows"]]
    skipped = result["meta"]["skipped"]
    # the eagle3 "tree" is a dynamic tree; DFlash's "tree" is a chain, so it runs
    assert set(skipped) == {"hf-assisted", "hf-prompt-lookup", "ngram:tree3", "eagle3:eagle3:tree"}
    assert not set(skipped) & set(names)
    assert "stateful" in skipped["hf-prompt-lookup"] and "chains" in skipped["eagle3:eagle3:tree"]
    assert {"vanilla", "draft-lm:chain4", "ngram:chain", "ngram:adaptive", "eagle3:eagle3:chain2",
            "dflash:dflash:tree", "dflash:dflash:chain2"} <= set(names)
    for row in result["rows"]:
        assert row["identical"], f"{row['method']} changed the greedy output on the hybrid"
    report = (out / "results.md").read_text()
    for name, reason in skipped.items():
        assert f"Skipped `{name}`: {reason}." in report
    assert all(set(p["ms_per_step"]) >= {"draft", "verify", "compact"} for p in result["profile"].values())
