"""scripts/bench_rollback.py on a tiny saved hybrid: both rollbacks next to plain decoding (τ, speedup, identical
output, the rollback's cost per step, replays and pending tokens), t(N); an attention target and an unknown
rollback are refused."""
from __future__ import annotations

import json

import pytest
import test_train_fixtures
from conftest import make_tiny_target
from hybrids import make_tiny_hybrid

from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.infer.recurrent import LinearAttentionLayer
from draftsmith.scripts.bench_rollback import main

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(test_train_fixtures.source_texts(), vocab_size=300)


def test_it_reports_both_rollbacks_and_the_verify_cost(tmp_path, tokenizer):
    target = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    assert main(["--target", str(tmp_path / "target"), "--max-new-tokens", "24", "--prompts", "2", "--repeats", "1",
                 "--threads", "1", "--paths", "3", "--depth", "4", "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["t_paths_ms"]) == {"1", "3"} and result["t_paths_over_t_1_path"]["1"] == 1.0
    assert set(result["methods"]) == {"ngram:merged", "ngram:replay"}
    merged, replay = result["methods"]["ngram:merged"], result["methods"]["ngram:replay"]
    for method in (merged, replay):
        assert method["identical"] and method["tau"] >= 1.0 and method["speedup"] > 0
        assert 0 <= method["rollback_share_of_step_time"] < 1
    assert merged["tau"] == replay["tau"]  # the same tokens, drafts and accepts: only the rollback differs
    assert replay["pending_tokens_per_step"] == 0 and merged["replays_per_step"] <= replay["replays_per_step"]
    assert set(result["t_verify_ms"]) == {"1", "2", "3", "4", "6", "8", "12", "16"}
    assert result["t_N_over_t_1"]["1"] == 1.0


def test_both_rules_and_a_reference_target_time_side_by_side(tmp_path, tokenizer):
    """--rules per-token,chunked runs every method with the routing of short verifies on and off (the same
    greedy text, so the same tau), and --reference-target times an attention target's verify beside them."""
    target = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    make_tiny_target("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "llama")
    assert main(["--target", str(tmp_path / "target"), "--max-new-tokens", "16", "--prompts", "1", "--repeats", "1",
                 "--threads", "1", "--rollback", "merged", "--rules", "per-token,chunked",
                 "--reference-target", str(tmp_path / "llama"), "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    routed, chunked = result["methods"]["ngram:merged:per-token"], result["methods"]["ngram:merged:chunked"]
    assert routed["identical"] and chunked["identical"] and routed["tau"] == chunked["tau"]
    assert set(result["t_N_over_t_1_by"]) == {"per-token", "chunked", str(tmp_path / "llama")}
    beside = result["reference"]["methods"]["ngram"]  # the reference target decoded in turn with the hybrid
    assert beside["identical"] and beside["tau"] >= 1.0 and result["reference"]["plain_tokens_per_s"] > 0
    assert all(by["1"] == 1.0 for by in result["t_N_over_t_1_by"].values())


def test_an_unknown_rule_and_reference_heads_without_a_reference_are_refused():
    with pytest.raises(SystemExit):
        main(["--rules", "per-token,fused"])
    with pytest.raises(SystemExit):
        main(["--reference-heads", "runs/x"])


def test_an_unknown_rollback_is_refused():
    with pytest.raises(SystemExit):
        main(["--rollback", "merged,undo"])


def test_an_attention_target_is_refused(tmp_path, tokenizer):
    make_tiny_target("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    with pytest.raises(SystemExit, match="keeps no recurrent state"):
        main(["--target", str(tmp_path / "llama"), "--threads", "1"])
