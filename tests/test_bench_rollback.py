"""scripts/bench_rollback.py on a tiny saved hybrid: the rollback's share of a step, replays, t(N) for N = 1..8;
an attention target is refused (nothing to roll back)."""
from __future__ import annotations

import json

import pytest
import test_train_fixtures
from conftest import make_tiny_target
from hybrids import make_tiny_hybrid

from data.tokenizer import train_tokenizer
from infer.recurrent import LinearAttentionLayer
from scripts.bench_rollback import main

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(test_train_fixtures.source_texts(), vocab_size=300)


def test_it_reports_the_rollback_and_the_verify_cost(tmp_path, tokenizer):
    target = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer))
    target.generation_config.eos_token_id = None
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    assert main(["--target", str(tmp_path / "target"), "--max-new-tokens", "24", "--prompts", "2", "--repeats", "1",
                 "--threads", "1", "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] > 0 and 1.0 <= result["tau"]
    assert set(result["t_verify_ms"]) == {str(n) for n in range(1, 9)} and result["t_N_over_t_1"]["1"] == 1.0
    assert "rollback" in result["phase_seconds"] or result["replays_per_step"] == 0
    assert 0 <= result["rollback_share_of_step_time"] < 1


def test_an_attention_target_is_refused(tmp_path, tokenizer):
    make_tiny_target("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    with pytest.raises(SystemExit, match="keeps no recurrent state"):
        main(["--target", str(tmp_path / "llama"), "--threads", "1"])
