"""lab/bench_rollback.py on a tiny saved hybrid: the three rollbacks next to plain decoding (τ, speedup, identical
output, the rollback's cost per step, replays and pending tokens), t(N); an attention target and an unknown
rollback are refused."""
from __future__ import annotations

import json

import pytest
from support import train_fixtures
from support.targets import make_tiny_target
from support.hybrids import make_tiny_hybrid

from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.target.recurrent import LinearAttentionLayer
from draftsmith.lab.bench_rollback import cli, main, parse_args

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(train_fixtures.source_texts(), vocab_size=300)


def test_it_reports_the_rollbacks_and_the_verify_cost(tmp_path, tokenizer):
    target = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    assert main(["--target", str(tmp_path / "target"), "--max-new-tokens", "24", "--prompts", "2", "--repeats", "1",
                 "--threads", "1", "--paths", "3", "--depth", "4", "--out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert set(result["t_paths_ms"]) == {"1", "3"} and result["t_paths_over_t_1_path"]["1"] == 1.0
    assert set(result["methods"]) == {"ngram:recorded", "ngram:merged", "ngram:replay"}
    recorded, merged, replay = (result["methods"][f"ngram:{m}"] for m in ("recorded", "merged", "replay"))
    for method in (recorded, merged, replay):
        assert method["identical"] and method["tau"] >= 1.0 and method["speedup"] > 0
        assert 0 <= method["rollback_share_of_step_time"] < 1
    assert recorded["tau"] == merged["tau"] == replay["tau"]  # the same drafts and accepts: only the rollback differs
    assert replay["pending_tokens_per_step"] == 0 and merged["replays_per_step"] <= replay["replays_per_step"]
    assert recorded["pending_tokens_per_step"] == recorded["replays_per_step"] == 0
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


def test_an_attention_target_is_refused(tmp_path, tokenizer, capsys):
    make_tiny_target("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    assert cli(["--target", str(tmp_path / "llama"), "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "keeps no recurrent state" in err[-1] and "Traceback" not in "".join(err)


def test_a_missing_or_attention_free_target_is_one_line(tmp_path, capsys):
    assert cli(["--target", str(tmp_path / "nowhere"), "--threads", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: target ")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mamba", vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mamba")
    assert cli(["--target", str(tmp_path / "mamba"), "--threads", "1"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: MambaForCausalLM (mamba): its Mamba-1 layers are not supported"), line


def test_out_never_replaces_a_users_file_and_a_folder_fails_before_the_run(tmp_path, capsys):
    """--out is checked with the arguments: a folder, or a file this script did not write, is refused by name
    before any target loads (the target here does not exist: its error would come later)."""
    mine = tmp_path / "u.json"
    mine.write_text('{"mine": 1}\n')
    for out, what in ((mine, "not a rollback benchmark report"), (tmp_path, "is a folder")):
        assert cli(["--target", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
        assert what in capsys.readouterr().err
    assert mine.read_text() == '{"mine": 1}\n'
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"target": "t", "command": "c"}))  # a report of this script's: may be replaced
    assert parse_args(["--out", str(ours)]).out == ours


def test_the_oracle_fixes_tau_on_both_targets(tmp_path, tokenizer, capsys):
    """--oracle D/A: every step accepts A of D on the hybrid and on the reference alike (τ = A + 1 but for the
    last steps), the output equals plain decoding, and each point reports the hybrid's speedup over the
    reference's, the rollback's share and the phases over t(1)."""
    target = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer))
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    make_tiny_target("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "llama")
    assert main(["--oracle", "4/1,4/3", "--target", str(tmp_path / "target"), "--reference-target",
                 str(tmp_path / "llama"), "--max-new-tokens", "24", "--prompts", "1", "--repeats", "1", "--threads", "1",
                 "--out", str(tmp_path / "o.json")]) == 0
    result = json.loads((tmp_path / "o.json").read_text())
    for key, right in (("D4/A1", 1), ("D4/A3", 3)):
        hybrid, reference = result["oracle"][key][str(tmp_path / "target")], result["oracle"][key]["reference"]
        assert hybrid["identical"] and reference["identical"] and hybrid["tau"] == reference["tau"]
        assert right < hybrid["tau"] <= right + 1 and hybrid["rollback_ms_per_step"] > 0
        assert hybrid["speedup_over_reference"] == round(hybrid["speedup"] / reference["speedup"], 3)
        assert {"verify", "draft", "rollback"} <= set(hybrid["phase_per_step_over_t1"])
    assert "| D4/A3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--oracle", "4/4", "--reference-target", "x"])  # A < D
    with pytest.raises(SystemExit):
        main(["--oracle", "4/1"])  # no reference to compare with
