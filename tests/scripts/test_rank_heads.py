"""scripts/rank_heads.py's rank correlation on hand-made rows, and its refusal of a folder that is no run."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from support.house import REPO
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.data.entry_point import run
from draftsmith.scripts.rank_heads import main, parse_args, ranks, spearman
from draftsmith.train.run import setup


def test_ranks_share_ties():
    assert ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks [1,2,3,4] and [2,1,4,3]: d^2 = 4, rho = 1 - 6*4/(4*15) = 0.6
    assert spearman([1, 2, 3, 4], [5.5, 5.0, 7.0, 6.0]) == pytest.approx(0.6)
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_a_folder_without_metrics_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args([str(tmp_path)])
    assert "no metrics.jsonl" in capsys.readouterr().err


def _fake_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "tau": 1.0}\n')
    return run_dir


def test_a_users_file_or_a_folder_as_out_is_refused_before_any_work(tmp_path, capsys):
    """--out of a user's file was replaced (exit 0), a folder ended in IsADirectoryError after every decode."""
    run_dir, theirs = _fake_run(tmp_path), tmp_path / "user.json"
    theirs.write_text('{"mine": 1}')
    for out, message in [(theirs, "exists and is not a head ranking draftsmith wrote"),
                         (tmp_path, "is a folder; name a file")]:
        with pytest.raises(OSError, match=message):
            parse_args([str(run_dir), "--out", str(out)])
        assert run(main, [str(run_dir), "--out", str(out)]) == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert theirs.read_text() == '{"mine": 1}'
    ours = tmp_path / "rank.json"  # a ranking draftsmith wrote is rewritten
    ours.write_text('{"rows": [], "spearman": {}}')
    assert parse_args([str(run_dir), "--out", str(ours)]).out == ours


def test_a_missing_target_is_one_line_from_the_command_line(tmp_path):
    """The script's own entry point (python scripts/rank_heads.py) ended in FileNotFoundError's traceback."""
    run_dir = _fake_run(tmp_path)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "rank_heads.py"), str(run_dir), "--target",
                           str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: target {tmp_path / 'nope'}: no such directory"]
    assert run(main, [str(run_dir), "--target", str(tmp_path / "nope")]) == 2


def test_real_tau_of_a_run_and_its_checkpoint(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "train.max_steps=6", "train.eval_every=3", "train.save_every=3",
                      "train.eval_decode_rows=2", "train.eval_decode_tokens=8"))
    report = tmp_path / "rank.json"
    code = main([str(out), str(out / "checkpoints" / "step-0000003"), "--target", str(tiny_files["target"]),
                 "--prompts", "2", "--max-new-tokens", "12", "--prompt-tokens", "8", "--out", str(report)])
    assert code == 0  # every decode equal to the target's own
    rows = json.loads(report.read_text())["rows"]
    evals = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tau" in r}
    assert [r["step"] for r in rows] == [6, 3]
    for row in rows:  # each head beside its own evaluation
        assert (row["simulated_tau"], row["decode_tau"]) == (evals[row["step"]]["tau"], evals[row["step"]]["decode_tau"])
        assert row["real_tau"] >= 1


def test_real_tau_at_each_temperature_beside_decode_tau_at_it(tiny_files, tmp_path):
    """--temperatures 0,1: real τ at T = 1 is the generator's over the same prompts, each under its own seed
    (pooled: tokens over steps summed first), ranked against the run's decode_tau_t1; vLLM's names per temperature."""
    from draftsmith.data.corpus import continuation_prompts
    from draftsmith.data.targets import load_target, load_target_tokenizer
    from draftsmith.heads import AutoHead
    from draftsmith.infer.drafters import adaptive_chain
    from draftsmith.infer.generator import SpeculativeGenerator
    from draftsmith.infer.seeded_decode import seeded_stats

    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, "train.max_steps=6", "train.eval_every=3", "train.save_every=3",
                      "train.eval_temperature=[0,1]"))
    report = tmp_path / "rank.json"
    heads = [str(out), str(out / "checkpoints" / "step-0000003")]
    assert main([*heads, "--target", str(tiny_files["target"]), "--prompts", "2", "--max-new-tokens", "12",
                 "--prompt-tokens", "8", "--temperatures", "0,1", "--out", str(report)]) == 0
    found = json.loads(report.read_text())
    assert set(found["spearman"]) == {"simulated_tau", "decode_tau", "decode_tau_t1"}
    row = found["rows"][0]
    assert row["decode_tau_t1"] == [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                                    if "tau" in r][-1]["decode_tau_t1"]
    target = load_target(str(tiny_files["target"]), attn_implementation="sdpa").eval()
    tokenizer = load_target_tokenizer(str(tiny_files["target"]))
    prompts = [torch.tensor(p)[None] for p in continuation_prompts(tokenizer, 2, 8, 12)]
    head = AutoHead.from_pretrained(str(out)).eval()
    gen = SpeculativeGenerator(target, adaptive_chain(head, target))  # the head's policy at every T, as decode τ's
    _, stats = seeded_stats(gen, prompts, max_new_tokens=12, temperature=1.0)
    assert sum(s.num_drafts for s in stats) > 0
    assert row["real_tau_t1"] == sum(s.step_tokens for s in stats) / sum(s.steps for s in stats)
    drafts, accepted = sum(s.num_drafts for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert row["mean_acceptance_length_t1"] == row["acceptance"]["1"]["mean_acceptance_length"] == 1 + accepted / drafts
    depth = max(len(s.num_accepted_tokens_per_pos) for s in stats)
    assert row["acceptance"]["1"]["num_accepted_tokens_per_pos"] == [
        sum(s.num_accepted_tokens_per_pos[i] for s in stats if i < len(s.num_accepted_tokens_per_pos))
        for i in range(depth)]


@pytest.mark.parametrize("option, value", [("--temperatures", "0.7,-0.5"), ("--temperatures", "nan"),
                                           ("--top-p", "1.5"), ("--top-k", "x")])
def test_a_sampling_value_is_refused_in_one_line(tmp_path, option, value, capsys):
    with pytest.raises(SystemExit):
        parse_args([str(_fake_run(tmp_path)), option, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in err and repr(value) in err
