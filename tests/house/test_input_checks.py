"""Values are checked where they enter (issue 22, principles 2 and 6): drafter constructors, draft
shapes, CLI and config parsing, export options, and the head files a head is loaded from."""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from safetensors.torch import load_file, save_file

from draftsmith.data.base.checks import count, probability
from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head
from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.drafters import Chain, DynamicTree, StaticTree, make_drafter
from draftsmith.infer.drafters.free.adaptive import AdaptiveLength
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.train.config import ConfigError, load_config


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama")


@pytest.mark.parametrize("make, message", [
    (lambda: NgramDrafter(length=2.5), "NgramDrafter length must be a whole number"),
    (lambda: NgramDrafter(length=0), "NgramDrafter length must be >= 1, got 0"),
    (lambda: NgramDrafter(branches=True), "NgramDrafter branches must be a whole number"),
    (lambda: NgramDrafter(min_ngram=3, max_ngram=2), "min_ngram <= max_ngram"),
    (lambda: AdaptiveLength(NgramDrafter(), initial=2.5), "AdaptiveLength initial must be a whole number"),
    (lambda: AdaptiveLength(NgramDrafter(), initial=5, maximum=4), "initial <= maximum"),
    (lambda: Chain(2.5), "Chain length must be a whole number"),
    (lambda: Chain(0), "Chain length must be >= 1"),
    (lambda: DynamicTree(depth=0), "DynamicTree depth must be >= 1, got 0"),
    (lambda: DynamicTree(total_tokens=1), "DynamicTree total_tokens must be >= 2"),
])
def test_drafter_and_shape_constructors_refuse_bad_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_confidence_is_a_probability(target):
    draft_lm = make_tiny_target("llama", num_layers=1, seed=1)
    with pytest.raises(ValueError, match=r"LMDrafter confidence must lie in \(0, 1\], got 5.0"):
        LMDrafter(draft_lm, target, Chain(2), confidence=5.0)
    assert LMDrafter(draft_lm, target, Chain(2), confidence=0.4).confidence == 0.4
    head = build_head("eagle3", target)
    with pytest.raises(ValueError, match=r"confidence must lie in \(0, 1\], got 0"):
        make_drafter(head, target, Chain(2), confidence=0)


def test_adaptive_length_wraps_drafters_not_heads(target):
    with pytest.raises(TypeError, match="AdaptiveLength wraps a drafter, got Eagle3Head"):
        AdaptiveLength(build_head("eagle3", target))


def test_checks_name_the_value():
    assert count("n", 3) == 3 and probability("p", 1) == 1.0 and probability("p", None) is None
    for bad in (float("nan"), "0.5", True, 0, 1.5):
        with pytest.raises(ValueError, match="p must"):
            probability("p", bad)


@pytest.mark.parametrize("script, argv, message", [
    ("scripts.bench_scale", ["--sizes", "0,-1"], "argument --sizes: comma-separated whole numbers >= 1 expected, got '0,-1'"),
    ("scripts.bench_scale", ["--num-prompts", "0"], "argument --num-prompts: a whole number >= 1 expected, got '0'"),
    ("scripts.bench_scale", ["--threads", "0"], "argument --threads: a whole number >= 1 expected"),
    ("scripts.benchmark", ["--target", "t", "--batch-sizes", "4,0"], "argument --batch-sizes: comma-separated whole"),
    ("scripts.benchmark", ["--target", "t", "--tree-sizes", "8,x"], "argument --tree-sizes: comma-separated whole"),
    ("scripts.benchmark", ["--target", "t", "--max-new-tokens", "2.5"], "argument --max-new-tokens: a whole number >= 1"),
    ("scripts.benchmark", ["--target", "t", "--warmup", "-1"], "argument --warmup: a whole number >= 0 expected"),
    ("lab.bench_rollback", ["--rollback", "merged,undo"],
     "argument --rollback: comma-separated names of recorded, merged, replay expected, got 'merged,undo'"),
    ("lab.gpu_report", ["--kinds", ","], "argument --kinds: comma-separated names of eagle3, eagle, medusa expected"),
])
def test_benchmark_clis_refuse_bad_counts(script, argv, message, capsys):
    """Counts and names are checked as they are parsed (0 and negative sizes ran, or failed minutes later)."""
    import importlib

    with pytest.raises(SystemExit) as stop:
        importlib.import_module(f"draftsmith.{script}").parse_args(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--matches", "0"), ("--max-new-tokens", "0")])
def test_generate_cli_refuses_zero_instead_of_defaulting(flag, value, capsys):
    from draftsmith.infer.generate_command import parse_args

    with pytest.raises(SystemExit) as stop:
        parse_args(["--head", "h", "--prompt", "p", flag, value])
    assert stop.value.code == 2
    assert f"argument {flag}: a whole number >=" in capsys.readouterr().err


def test_generate_cli_notes_top_p_and_top_k_unused_at_temperature_0(capsys):
    """`generate --temperature 0 --top-p 0.5 --top-k 3` took both without a word (greedy decoding reads neither)."""
    from draftsmith.infer.generate_command import parse_args

    parse_args(["--head", "h", "--prompt", "p", "--temperature", "0", "--top-p", "0.5", "--top-k", "3"])
    assert capsys.readouterr().err.strip().splitlines() == [
        "warning: --top-p 0.5 and --top-k 3 shape sampling only; --temperature 0 decodes greedily (set --temperature "
        "> 0 to sample)"]
    parse_args(["--head", "h", "--prompt", "p", "--top-k", "3"])
    assert capsys.readouterr().err.startswith("warning: --top-k 3 shape sampling only")
    for quiet in (["--temperature", "0.7", "--top-p", "0.5", "--top-k", "3"], []):
        parse_args(["--head", "h", "--prompt", "p", *quiet])
        assert capsys.readouterr().err == ""


class _Parsed(BaseException):
    """Raised instead of parsing: carries the parser an entry point built."""


# scripts.launch parses nothing itself: accelerate's parser takes its options, the training config the rest
ENTRY_POINTS = [*({module for module, _, _ in __import__("draftsmith.scripts.commands").scripts.commands.COMMANDS.values()} - {"draftsmith.scripts.launch"}),
                "draftsmith.scripts.plot_runs", "draftsmith.scripts.calibrate_layer_skip",
                # lab/: our own harnesses, run from a clone
                "draftsmith.lab.bench_data_pipeline", "draftsmith.lab.bench_features", "draftsmith.lab.bench_rollback",
                "draftsmith.lab.gpu_report", "draftsmith.lab.gpu_lease", "draftsmith.lab.acceptance_curve"]


def _parser_of(module_name: str, monkeypatch):
    import importlib
    import inspect

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    monkeypatch.setattr("argparse.ArgumentParser.parse_known_args", capture)
    monkeypatch.setattr("sys.argv", [module_name, "--help"])
    module = importlib.import_module(module_name)
    entry = getattr(module, "cli", None) or module.main
    try:
        entry(["--help"]) if inspect.signature(entry).parameters else entry()
    except _Parsed as parsed:
        return parsed.args[0]
    raise AssertionError(f"{module_name} parsed no arguments")


@pytest.mark.parametrize("module_name", sorted(ENTRY_POINTS))
def test_every_numeric_option_is_checked_as_it_is_parsed(module_name, monkeypatch):
    """Principle 2 for options not yet probed: no entry point takes a bare int or float (a 0, a negative
    count or a NaN would run, or fail later in a loop); each goes through data.base.checks."""
    parser = _parser_of(module_name, monkeypatch)
    bare = [action.option_strings[0] for action in parser._actions if action.type in (int, float)]
    assert not bare, f"{module_name}: {bare} parsed as bare int/float"


@pytest.mark.parametrize("module_name, argv, message", [
    ("draftsmith.scripts.regenerate", ["--target", "t", "--data", "d", "--out", "o", "--timeout", "nan"],
     "argument --timeout: a number > 0 expected, got 'nan'"),
    ("draftsmith.scripts.drift", ["--head", "h", "--target", "t", "--threshold", "0"], "argument --threshold: a number > 0"),
    ("draftsmith.scripts.cost", ["--gpus", "0"], "argument --gpus: a whole number >= 1 expected, got '0'"),
    ("draftsmith.scripts.speculation_plan", ["--target", "t", "--head", "h", "--lengths", "2,-1"],
     "argument --lengths: comma-separated whole numbers >= 0 expected"),
    ("draftsmith.infer.generate_command", ["--head", "h", "--prompt", "p", "--top-p", "1.5"], "argument --top-p: a number > 0 and <= 1"),
    ("draftsmith.infer.generate_command", ["--head", "h", "--prompt", "p", "--temperature", "-0.1"], "argument --temperature: a number >= 0"),
])
def test_bad_numbers_end_in_one_line_with_exit_code_2(module_name, argv, message, capsys):
    import importlib

    module = importlib.import_module(module_name)
    with pytest.raises(SystemExit) as stop:
        (getattr(module, "parse_args", None) or module.main)(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and message in err and "Traceback" not in err


def test_export_refuses_zero_context_and_speculative_tokens(target, tmp_path):
    head = build_head("eagle3", target)
    with pytest.raises(ValueError, match="max_position_embeddings must be >= 1, got 0"):
        export_head(head, tmp_path / "a", "vllm", target=target, max_position_embeddings=0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        export_head(head, tmp_path / "b", "speculators", target=target, num_speculative_tokens=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_yaml_booleans_for_mixed_precision(tmp_path):
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"  # YAML: no -> false
    (tmp_path / "c.yaml").write_text("train:\n  mixed_precision: no\n")
    assert load_config(tmp_path / "c.yaml").train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="quote it"):
        load_config(None, ["train.mixed_precision=yes"])


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_a_head_missing_a_tensor_is_refused(kind, target, tmp_path):
    build_head(kind, target).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = sorted(weights)[-1]
    del weights[dropped]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing: {dropped}"):
        AutoHead.from_pretrained(tmp_path)


def test_a_medusa_config_declaring_more_heads_than_the_file_is_refused(target, tmp_path):
    build_head("medusa", target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_heads"] += 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"do not match its config.json \(missing: .*heads\.\d"):
        AutoHead.from_pretrained(tmp_path)
    config["num_heads"] -= 2  # fewer heads than the file holds: tensors the config does not declare
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not declared by its config"):
        AutoHead.from_pretrained(tmp_path)


def test_a_head_where_a_language_model_is_expected(target, tmp_path):
    from draftsmith.data.targets import resolve_target

    build_head("eagle3", target).save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match=r"target .*head: is a draftsmith eagle3 head, not a language model"):
        resolve_target(tmp_path / "head")
    with pytest.raises(ValueError, match="draft LM .*: is a draftsmith eagle3 head"):
        resolve_target(tmp_path / "head", role="draft LM")
    with pytest.raises(FileNotFoundError, match="draft LM .*missing: no such directory"):
        resolve_target(tmp_path / "missing", role="draft LM")
    target.save_pretrained(tmp_path / "lm")
    assert resolve_target(tmp_path / "lm") == str(tmp_path / "lm")


def test_export_names_nan_weights(target, tmp_path):
    head = build_head("eagle3", target)
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or infinite weights in \['fc.weight'\]"):
        export_head(head, tmp_path / "out", "vllm", target=target)
    assert not (tmp_path / "out").exists()


def test_a_head_with_only_pickled_weights_is_refused_without_unpickling(target, tmp_path):
    build_head("medusa", target).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")  # not even a pickle: never opened
    with pytest.raises(ValueError, match="holds only pickled weights \\(pytorch_model.bin\\); draftsmith heads load"):
        AutoHead.from_pretrained(tmp_path)


def test_every_head_kind_is_recognised_as_a_head_by_its_model_type():
    from draftsmith.data.base.names import is_head_model_type
    from draftsmith.heads import HEAD_CLASSES

    for kind, cls in HEAD_CLASSES.items():  # output-dir safety, export refusal and targets read the prefix
        assert is_head_model_type(cls.config_class.model_type), kind
    assert not is_head_model_type("llama") and not is_head_model_type(None)


def test_a_file_given_as_the_head_is_named(tmp_path):
    """Was transformers' "the config file at 'notes.txt' is not a valid JSON file"."""
    from draftsmith.data.targets import check_head_source

    notes = tmp_path / "notes.txt"
    notes.write_text("hello\n")
    with pytest.raises(FileNotFoundError, match=r"head .*notes\.txt: is a file; pass the head's directory"):
        check_head_source(notes)


def test_a_device_this_torch_cannot_use_is_refused_naming_it(capsys):
    """--device cuda on a machine without CUDA ended in torch's AssertionError traceback (exit code 1)."""
    from draftsmith.data.base.device import default_device
    from draftsmith.infer.generate_command import cli

    with pytest.raises(ValueError, match="device 'foo' is not a torch device"):
        default_device("foo")
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"device '{missing}'"):
        default_device(missing)
    assert default_device("cpu") == torch.device("cpu")
    assert cli(["--head", "h", "--prompt", "p", "--device", missing]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: device '{missing}'")


def test_report_files_replace_only_what_draftsmith_wrote(tmp_path):
    """drift --out and speculation_plan --out wrote over any file named (a README.md, say)."""
    from draftsmith.data.base.paths import claim_report_file, json_with_keys

    ours = json_with_keys("lengths")
    theirs = tmp_path / "README.md"
    theirs.write_text("# mine\n")
    with pytest.raises(FileExistsError, match=f"--out {theirs} exists and is not a speculation plan draftsmith wrote"):
        claim_report_file(theirs, ours, "speculation plan")
    (tmp_path / "plan.json").write_text('{"lengths": {"1": 3}}')
    assert claim_report_file(tmp_path / "plan.json", ours, "speculation plan") == tmp_path / "plan.json"
    assert claim_report_file(tmp_path / "new.json", ours, "speculation plan") == tmp_path / "new.json"
    with pytest.raises(IsADirectoryError):
        claim_report_file(tmp_path, ours, "speculation plan")
    for script, argv in [("draftsmith.scripts.drift", ["--head", "h", "--target", "t", "--out", str(theirs)]),
                         ("draftsmith.scripts.speculation_plan", ["--target", "t", "--head", "h", "--out", str(theirs)])]:
        with pytest.raises(FileExistsError, match="never replaced"):  # refused before anything loads
            __import__(script, fromlist=["main"]).main(argv)
    assert theirs.read_text() == "# mine\n"


@pytest.mark.parametrize("make, message", [
    (lambda t, h: SpeculativeGenerator(t, h, acceptance="typical", typical_threshold=-1),
     r"typical_threshold must lie in \(0, 1\], got -1"),
    (lambda t, h: SpeculativeGenerator(t, h, typical_alpha=0), r"typical_alpha must lie in \(0, 1\], got 0"),
    (lambda t, h: SpeculativeGenerator(t, h, compile=5), "compile must be True, False, None or a torch.compile backend"),
    (lambda t, h: SpeculativeGenerator(t, h, compile="inductr"), "compile='inductr' is not a torch.compile backend"),
    (lambda t, h: SpeculativeGenerator(t, h, plan=5), "plan must be a SpeculationPlan, the path of one or None, got int"),
    (lambda t, h: SpeculativeGenerator(t, h, per_token="no"), "per_token must be True or False, got 'no'"),
    (lambda t, h: SpeculativeGenerator(t, h, profile=1), "profile must be True or False, got 1"),
    (lambda t, h: SpeculativeGenerator(t, h).generate(torch.tensor([[1, 2]]), max_new_tokens=2,
                                                      attention_mask=torch.tensor([[0.5, 1.0]])),
     r"attention_mask must hold 0 \(pad\) and 1 \(token\) only, got 0.5"),
    (lambda t, h: SpeculativeGenerator(t, h).generate(torch.tensor([[1, 2]]), max_new_tokens=2, eos_token_id=-1),
     r"eos_token_id must be a token id or a list of them in \[0, \d+\), got -1"),
    (lambda t, h: SpeculativeGenerator(t, h).generate(torch.tensor([[1, 2]]), max_new_tokens=2, eos_token_id="</s>"),
     "eos_token_id must be a token id"),
    (lambda t, h: build_head("eagle3", t, draft_vocab_size=0), "draft_vocab_size must be >= 1, got 0"),
    (lambda t, h: build_head("medusa", t, num_heads=2.5), "Medusa num_heads must be a whole number >= 1, got 2.5"),
    (lambda t, h: StaticTree([]), "non-empty paths"),
    (lambda t, h: StaticTree([[0, -1]]), "non-negative ranks"),
    (lambda t, h: StaticTree([[0, 0]]), r"Medusa choice \[0, 0\] has no parent path \[0\]"),
    (lambda t, h: StaticTree(5), "StaticTree choices must be paths of ranks"),
    (lambda t, h: StaticTree(((0,),), sampled="yes"), "StaticTree sampled must be True or False, got 'yes'"),
    (lambda t, h: SpeculativeGenerator(t, h, acceptance="travers"), r"acceptance must be one of \('exact', "
                                                                      r"'traversal', 'typical'\), got 'travers'"),
    (lambda t, h: make_drafter(build_head("medusa", t), t, StaticTree(((0,),), sampled=True)),
     r"StaticTree\(sampled=True\) draws each node's children from its law: EAGLE heads draft it"),
])
def test_generator_heads_and_trees_refuse_bad_values_where_they_enter(target, make, message):
    """Each was accepted (a negative threshold, compile=5 read as true, draft_vocab_size=0 read as the whole
    vocabulary, an eos id no token has) or failed later with a message naming nothing."""
    with pytest.raises(ValueError, match=message):
        make(target, build_head("eagle3", target))


def test_a_prompts_file_cut_mid_line_names_that_line(tmp_path):
    """drift and speculation-plan read --prompts through load_prompts; a file cut inside its second row was
    "Expecting ',' delimiter: line 1 column 14" (json's count inside the one line it was given)."""
    import argparse

    from draftsmith.infer.bench.prompts import load_prompts
    from draftsmith.scripts import drift, speculation_plan

    class Tokenizer:
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    assert drift.load_prompts is load_prompts is speculation_plan.load_prompts
    path = tmp_path / "prompts.jsonl"
    args = argparse.Namespace(prompts=str(path), num_prompts=8)
    path.write_text('{"prompt": "ab"}\n\n{"prompt": "c')
    with pytest.raises(ValueError, match=rf"^{path}:3: invalid JSON at column 12: Unterminated string"):
        load_prompts(args, Tokenizer())
    path.write_text('{"prompt": "ab"}\n["c"]\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: a prompt row is a JSON object .*, got list"):
        load_prompts(args, Tokenizer())
    path.write_text('{"prompt": "ab"}\n{"prompt": "c"}\n')
    assert load_prompts(args, Tokenizer()) == [[97, 98], [99]]
