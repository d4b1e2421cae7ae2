"""scripts/benchmark.py end to end on a tiny saved target: every method measured, files written."""
from __future__ import annotations

import importlib.util
import json

import pytest

from support.targets import make_tiny_target
from support.benchmark import ROOT, load_script
from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.heads import build_head


@pytest.fixture(scope="module")
def bench_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    target = make_tiny_target("llama", vocab_size=len(tokenizer), num_layers=6)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    heads = []
    for kind in ("medusa", "eagle3", "early-exit"):
        build_head(kind, target).save_pretrained(root / kind)
        heads.append(str(root / kind))
    assistant = make_tiny_target("llama", vocab_size=len(tokenizer), num_layers=1, seed=1)
    assistant.save_pretrained(root / "assistant")
    build_head("eagle", assistant).save_pretrained(root / "assistant-head")  # a head of the assistant
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("def add(a,", "for i in")) + "\n")
    return root, heads, prompts


def test_benchmark_measures_every_method(bench_dirs):
    root, heads, prompts = bench_dirs
    out = root / "out"
    result = load_script().main([
        "--target", str(root / "target"), "--heads", *heads, "--assistant", str(root / "assistant"),
        "--assistant-head", str(root / "assistant-head"),
        "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8", "--ignore-eos",
        "--repeats", "1", "--warmup", "0", "--tree-sizes", "1,4,8", "--profile", "--out", str(out),
        "--trees", "tree,chain2,dyn3-2-5,medusa4", "--adaptive", "--layer-skip", "3", "--lookup-first",
    ])
    names = [r["method"] for r in result["rows"]]
    assert names[:12] == ["vanilla", "hf-static", "hf-assisted", "draft-lm:chain4", "draft-lm:adaptive",
                          "draft-lm+ngram:chain4", "draft-lm+head:chain4", "hf-prompt-lookup", "ngram:chain",
                          "ngram:tree3", "ngram:adaptive", "layer-skip:3"]
    # each head gets the trees that fit its kind: no dynamic tree for Medusa, static ones for EAGLE-3 too,
    # chains only for early exit
    assert names[12:] == ["medusa:medusa:tree", "medusa:medusa:chain2", "medusa:medusa:medusa4",
                         "medusa:medusa:lookup-first", "medusa:medusa:adaptive",
                         "eagle3:eagle3:tree", "eagle3:eagle3:chain2", "eagle3:eagle3:dyn3-2-5",
                         "eagle3:eagle3:medusa4", "eagle3:eagle3:lookup-first", "eagle3:eagle3:adaptive",
                         "early-exit:early-exit:chain2", "early-exit:early-exit:lookup-first",
                         "early-exit:early-exit:adaptive"]
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
    assert list(profiles) == [n for n in names if n not in ("vanilla", "hf-static", "hf-assisted", "hf-prompt-lookup")]
    for name, prof in profiles.items():
        phases = prof["ms_per_step"]
        assert set(phases) == {"draft", "observe", "verify", "accept", "compact", "rollback", "emit"}
        assert phases["draft"] > 0 and phases["verify"] > 0 and min(phases.values()) >= 0
        assert phases["rollback"] == 0  # an attention target rolls nothing back
        assert prof["step_ms"] == pytest.approx(sum(phases.values()))
        assert 1.0 <= prof["tokens_per_step"] and 0 < prof["drafting_share"] < 1
    assert "Where a step's time goes" in (out / "results.md").read_text()


def test_the_default_methods_include_what_infer_generate_decodes(bench_dirs):
    """On CPU an EAGLE head decodes with its adaptive chain by default (python -m draftsmith.infer.generate_command): the
    benchmark's default --trees runs it too, so the head is not judged by shapes nobody decodes with; a
    default equal to another tree (Medusa's is its static tree) runs once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.infer.bench.methods import build_methods

    root, heads, _ = bench_dirs
    module = load_script()
    args = module.parse_args(["--target", str(root / "target"), "--heads", *heads[:2], "--no-prompt-lookup",
                              "--no-hf-static"])
    assert args.trees == ["default", "tree", "chain4"]
    target = AutoModelForCausalLM.from_pretrained(root / "target").eval()
    methods = build_methods(args, target, AutoTokenizer.from_pretrained(root / "target"))
    names = [m.name for m in methods]
    assert names == ["vanilla", "medusa:medusa:default", "medusa:medusa:chain4", "eagle3:eagle3:default",
                     "eagle3:eagle3:tree", "eagle3:eagle3:chain4"]
    assert type(methods[3].generator.drafter.greedy).__name__ == "AdaptiveLength"  # the CPU default, greedy
    args.adaptive = True  # the same adaptive chain again: run once
    names.insert(3, "medusa:medusa:adaptive")  # after each head's trees
    assert [m.name for m in build_methods(args, target, AutoTokenizer.from_pretrained(root / "target"))] == names


def test_benchmark_static_path_counts_from_the_generator(bench_dirs):
    """Heads on the static decode state: counts come from the generator (hooks would miss compiled
    replays), tokens per verify is the padded budget, t(N) is the static step's, and every speedup
    is also given against HF's static-cache generate."""
    root, heads, prompts = bench_dirs
    result = load_script().main([
        "--target", str(root / "target"), "--heads", heads[1], "--prompts", str(prompts), "--num-prompts", "2",
        "--max-new-tokens", "8", "--ignore-eos", "--repeats", "1", "--warmup", "0", "--tree-sizes", "1,3",
        "--no-prompt-lookup", "--trees", "chain2", "--compile", "eager",
        "--out", str(root / "out-static"),
    ])
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["vanilla", "hf-static", "eagle3:chain2"]
    head = rows["eagle3:chain2"]
    assert head["identical"] and rows["hf-static"]["identical"]
    assert head["tokens_per_verify"] == pytest.approx(3.0)  # root + 2 drafts, every step
    assert rows["hf-static"]["speedup_vs_hf_static"] == pytest.approx(1.0)
    assert head["speedup_vs_hf_static"] > 0 and head["tau"] >= 1.0
    assert set(result["verification_cost_s"]) == {1, 3}
    assert "vs hf-static" in (root / "out-static" / "results.md").read_text()


def test_prompt_file_rows_must_have_prompt_or_messages(bench_dirs, tmp_path):
    root, heads, _ = bench_dirs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"question": "y"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a prompt row needs 'prompt' or 'messages'"):
        load_script().main(["--target", str(root / "target"), "--prompts", str(bad), "--out", str(tmp_path / "o")])


def test_unknown_tree_spec_is_refused(bench_dirs, tmp_path, capsys):
    root, heads, prompts = bench_dirs
    with pytest.raises(SystemExit):
        load_script().main(["--target", str(root / "target"), "--heads", *heads, "--trees", "tree,dyn3-2",
                             "--out", str(tmp_path / "o")])
    assert "--trees: tree shape 'dyn3-2': expected default, tree, chainN, dynD-K-N or medusaN" in capsys.readouterr().err


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


def test_prompts_file_with_messages_rows():
    """apply_chat_template returns a BatchEncoding (a Mapping, not a dict): its input_ids are the prompt."""
    import argparse

    from draftsmith.data.tokenizer import train_tokenizer as make

    tokenizer = make(["hello there, how are you", "fine thanks"] * 10, vocab_size=300)
    assert tokenizer.chat_template
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hello there"}]}) + "\n")
        f.write(json.dumps({"prompt": "how are you"}) + "\n")
    args = argparse.Namespace(prompts=f.name, num_prompts=8, prompt_tokens=16, max_new_tokens=8)
    prompts = load_script().load_prompts(args, tokenizer)
    assert len(prompts) == 2 and all(isinstance(t, int) for p in prompts for t in p)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                             add_generation_prompt=True, tokenize=True)
    assert prompts[0] == list(expected["input_ids"])


def test_benchmark_batch_sizes_compare_with_hf_batched_static(bench_dirs):
    """--batch-sizes: our batch speculation next to HF's batched static-cache generate, per batch size;
    every row's greedy output identical to HF's."""
    root, heads, prompts = bench_dirs
    out = root / "out-batch"
    result = load_script().main([
        "--target", str(root / "target"), "--heads", heads[1], "--prompts", str(prompts), "--num-prompts", "2",
        "--max-new-tokens", "8", "--ignore-eos", "--repeats", "1", "--warmup", "0", "--tree-sizes", "1",
        "--trees", "chain2", "--compile", "false", "--batch-sizes", "1,4", "--out", str(out),
    ])
    batch = result["batch"]
    assert [(r["batch_size"], r["method"]) for r in batch] == [
        (b, m) for b in (1, 4) for m in ("hf-static", "ngram:chain", "ngram:tree3", "ngram:adaptive", "eagle3:chain2")]
    for r in batch:
        assert r["identical"], r
        assert r["new_tokens"] == 8 * r["batch_size"] and r["tokens_per_s"] > 0
    assert "## Batches" in (out / "results.md").read_text()


def test_max_minutes_stops_between_prompts_with_the_same_prompts_for_every_method(bench_dirs, capsys):
    """--max-minutes: past the deadline no new prompt starts; every method keeps the prompts timed so
    far (at least one), and the report counts those (the GPU report's benchmark phase uses it)."""
    root, heads, prompts = bench_dirs
    result = load_script().main([
        "--target", str(root / "target"), "--heads", heads[0], "--prompts", str(prompts), "--num-prompts", "2",
        "--max-new-tokens", "6", "--ignore-eos", "--repeats", "1", "--warmup", "0", "--tree-sizes", "1",
        "--no-prompt-lookup", "--no-hf-static", "--trees", "chain2", "--max-minutes", "0.0001",
        "--out", str(root / "out-deadline"),
    ])
    assert result["meta"]["num_prompts"] == 1
    assert all(len(runs) == 1 for runs in result["runs"].values())
    assert all(row["identical"] for row in result["rows"])
    assert "time is up after 1 of 2 prompts" in capsys.readouterr().out  # the prompts file holds two
    with pytest.raises(SystemExit):
        load_script().parse_args(["--target", "t", "--max-minutes", "0"])


def test_assistant_head_needs_the_assistant(capsys):
    with pytest.raises(SystemExit) as err:
        load_script().parse_args(["--target", "t", "--assistant-head", "h"])
    assert err.value.code == 2 and "--assistant-head guesses the assistant's drafts: pass --assistant" in capsys.readouterr().err


def test_sampled_decoding_at_each_temperature_with_vllms_acceptance_names(bench_dirs):
    """--temperatures 0,1: the greedy table as before (with vLLM's acceptance names pooled over prompts), plus HF's
    sampled generate and each generator method at T = 1, seeded per prompt: τ with its interval, tokens/s, speedup.
    A chain of 2 drafts at every step (the default at T > 0 chooses from measured costs, and may draft nothing)."""
    root, heads, prompts = bench_dirs
    out = root / "out-sampled"
    result = load_script().main([
        "--target", str(root / "target"), "--heads", heads[1], "--prompts", str(prompts), "--num-prompts", "2",
        "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0", "--tree-sizes", "1,4", "--no-prompt-lookup",
        "--no-hf-static", "--trees", "chain2", "--temperatures", "0,1", "--top-k", "20", "--out", str(out)])
    head_row = result["rows"][1]
    counts = [r["acceptance"] for r in result["runs"][head_row["method"]]]
    drafts, accepted = sum(c["num_drafts"] for c in counts), sum(c["num_accepted_tokens"] for c in counts)
    assert drafts > 0 and head_row["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    sampled = result["sampled"]
    assert [(r["method"], r["temperature"]) for r in sampled] == [("hf-sampled", 1.0), (head_row["method"], 1.0)]
    row = sampled[1]
    assert row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["num_drafts"] > 0
    assert row["tau"] == row["step_tokens"] / row["steps"] and row["tau_low"] <= row["tau"] <= row["tau_high"]
    assert row["mean_acceptance_length"] == pytest.approx(1 + row["num_accepted_tokens"] / row["num_drafts"])
    assert "Sampled decoding" in (out / "results.md").read_text()


def test_sampled_timing_starts_after_the_chains_step_costs_are_measured(bench_dirs, tmp_path, monkeypatch):
    """At T > 0 the CPU default chain measures its step costs (infer.cost_profile) on its first sampled decode, once
    per key; with --warmup 0 the bench measures them before its first timed decode, so no tokens/s counts them (a
    one-prompt run on demo:smollm2 read 0.6 tokens/s for the head against 12.5 for HF's sampled generate)."""
    from draftsmith.infer import cost_profile
    from draftsmith.infer.bench import sampled

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))  # no stored step costs: this run measures them
    timing, measured = [False], []
    measure, median = cost_profile.measure_curve, sampled._median_seconds

    def recorded_measure(*args, **kwargs):
        measured.append(timing[0])
        return measure(*args, **kwargs)

    def timed_median(*args, **kwargs):
        timing[0] = True
        try:
            return median(*args, **kwargs)
        finally:
            timing[0] = False

    monkeypatch.setattr(cost_profile, "measure_curve", recorded_measure)
    monkeypatch.setattr(sampled, "_median_seconds", timed_median)
    root, heads, prompts = bench_dirs
    load_script().main([
        "--target", str(root / "target"), "--heads", heads[1], "--prompts", str(prompts), "--num-prompts", "1",
        "--max-new-tokens", "4", "--repeats", "1", "--warmup", "0", "--tree-sizes", "1", "--no-prompt-lookup",
        "--no-hf-static", "--trees", "default", "--temperatures", "0,1", "--out", str(tmp_path / "out")])
    assert measured == [False]  # measured once, outside every timed call


@pytest.mark.parametrize("option, value, said", [("--temperatures", "0,-1", "'-1' is no temperature"),
                                                 ("--temperatures", "0,inf", "'inf' is no temperature"),
                                                 ("--temperatures", "1,1", "'1' is listed twice"),
                                                 ("--top-p", "0", "got '0'"), ("--top-k", "-3", "got '-3'")])
def test_a_sampling_value_no_rule_takes_is_refused_in_one_line(option, value, said, capsys):
    with pytest.raises(SystemExit):
        load_script().parse_args(["--target", "demo:tiny", option, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in err and said in err


def test_a_methods_acceptance_pools_its_prompts_counts():
    """mean_acceptance_length over prompts is 1 + all accepted / all drafts (1.75 here), not the mean of the
    prompts' own (4 and 1: 2.5)."""
    from draftsmith.infer.bench.methods import Method
    from draftsmith.infer.bench.report import pooled_acceptance

    long = {"num_drafts": 1, "num_draft_tokens": 3, "num_accepted_tokens": 3, "num_accepted_tokens_per_pos": [1, 1, 1],
            "acceptance_histogram": {3: 1}}
    short = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": [],
             "acceptance_histogram": {0: 3}}
    pooled = pooled_acceptance(Method("head", "head", None, runs=[{"acceptance": long}, {"acceptance": short}]))
    assert pooled["mean_acceptance_length"] == 1.75
    assert pooled["acceptance"]["acceptance_rate_per_pos"] == [0.25, 0.25, 0.25]
    assert pooled_acceptance(Method("vanilla", "vanilla", None, runs=[{"tokens": []}])) == {}


def test_heads_with_one_folder_name_get_their_parents_and_variants_in_the_label():
    """Two runs' best/ folders (a DFlash and a DSpark head) were one label 'dflash:best:default' in the tables."""
    from draftsmith.infer.bench.methods import head_label

    target = make_tiny_target("llama", vocab_size=64, num_layers=4)
    dflash, dspark = build_head("dflash", target, block_size=4), build_head("dflash", target, block_size=4,
                                                                             variant="dspark")
    dirs = ["runs/demo-dflash/best", "runs/demo-dspark/best", "runs/other"]
    assert [head_label(dflash, dirs[0], dirs), head_label(dspark, dirs[1], dirs), head_label(dflash, dirs[2], dirs)] == [
        "dflash:demo-dflash/best", "dspark:demo-dspark/best", "dflash:other"]
    assert head_label(dspark, dirs[1], dirs[1:2]) == "dspark"
