"""``python -m draftsmith.infer.generate_command`` and ``SpeculativeGenerator.from_pretrained`` on saved tiny models."""
from __future__ import annotations

import re

import pytest
import torch
from support.targets import make_tiny_target
from support.reference import hf_greedy
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.heads import build_head
from draftsmith.infer import DynamicTree, SpeculativeGenerator
from draftsmith.infer.generate_command import main

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
# --compare with one timed round: the streamed decode, the warm-up and the round are three decodes of one generator,
# each checked against the target's own; the alternation of R rounds is test_compare_alternates_timed_rounds' claim
COMPARE = ["--compare", "--rounds", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    vocab.update({f"w{i}": i for i in range(5, 96)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", chat_template=CHATML
    )
    target = make_tiny_target("llama", initializer_range=0.3)  # qwen2 dirs load Qwen2Tokenizer
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    torch.manual_seed(0)
    build_head("eagle3", target).save_pretrained(root / "head")
    return root


def test_from_pretrained_matches_vanilla(saved):
    gen = SpeculativeGenerator.from_pretrained(str(saved / "target"), str(saved / "head"), device="cpu")
    assert gen.tokenizer is not None and gen.head.head_kind == "eagle3"
    ids = torch.tensor([[7, 8, 9, 10]])
    ref = hf_greedy(gen.target, ids, 20)
    assert torch.equal(gen.generate(ids, max_new_tokens=20), ref)


@pytest.mark.parametrize("extra", [[], ["--chat"], ["--tree", "chain3"], ["--tree", "dyn3-2-6"]])
def test_cli_streams_and_compares(saved, capsys, extra):
    code = main([
        "--target", str(saved / "target"), "--head", str(saved / "head"), "--prompt", "w7 w8 w9",
        "--max-new-tokens", "16", *COMPARE, "--device", "cpu", *extra,
    ])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.out.strip()  # streamed text
    assert "tau" in captured.err and "tok/s" in captured.err
    assert "outputs identical: yes" in captured.err and "speedup" in captured.err


def test_cli_refuses_shapes_a_head_cannot_draft_and_the_old_shape_flags(saved, tmp_path, capsys):
    """Through the entry point: one line and exit code 2 (a SystemExit with a message exited with 1); the old
    ``--depth/--branch/--total-tokens`` each name the ``--tree`` that says the same."""
    from draftsmith.infer.generate_command import cli

    target = make_tiny_target("llama")
    build_head("medusa", target).save_pretrained(tmp_path / "medusa")
    base = ["--target", str(saved / "target"), "--head", str(tmp_path / "medusa"), "--prompt", "w7"]
    with pytest.raises(ValueError, match="a medusa head cannot draft it"):
        main([*base, "--tree", "dyn3-2-6"])
    assert cli([*base, "--tree", "dyn3-2-6"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: tree shape 'dyn3-2-6'")
    assert cli([*base, "--adaptive", "--tree", "tree"]) == 2
    assert "error: --adaptive adapts a chain" in capsys.readouterr().err
    for old, new in (("--depth", "--tree chainD"), ("--branch", "--tree dynD-K-N"), ("--total-tokens", "dynD-K-N")):
        with pytest.raises(SystemExit) as stop:
            main([*base, old, "3"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and lines[-1].startswith(f"python -m draftsmith.infer.generate_command: error: {old} is gone") \
            and new in lines[-1], lines
    with pytest.raises(SystemExit):
        main([*base, "--tree", "chain"])
    assert "a chain of D drafts is chainD, e.g. chain4" in capsys.readouterr().err


def test_cli_defaults_to_the_target_the_head_was_made_for(saved, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(saved / "target")  # name_or_path = the directory
    build_head("eagle3", loaded).save_pretrained(tmp_path / "head")
    code = main(["--head", str(tmp_path / "head"), "--prompt", "w7 w8", "--max-new-tokens", "8", *COMPARE,
                 "--device", "cpu"])
    assert code == 0 and "outputs identical: yes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="records no target"):  # built from an in-memory model
        main(["--head", str(saved / "head"), "--prompt", "w7"])


def test_threads_are_chosen_by_measurement_and_printed(monkeypatch):
    import draftsmith.target.threads as threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "probe_seconds", lambda n, give_up=None, rows=64: {1: 1.0, 2: 5.0}[n])  # a busy machine
        line = threads.choose_threads()
        assert torch.get_num_threads() == 1 and line.startswith("threads: 1 of 2 cores, chosen by measurement")
        monkeypatch.setattr(threads, "probe_seconds", lambda n, give_up=None, rows=64: {1: 1.0, 2: 0.6}[n])  # an idle one
        assert threads.choose_threads().startswith("threads: 2 of 2") and torch.get_num_threads() == 2
        assert threads.choose_threads(1) == "threads: 1 of 2 cores (--threads)"
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert "(OMP_NUM_THREADS)" in threads.choose_threads()
    finally:
        torch.set_num_threads(before)


def test_cli_prints_its_thread_count(saved, capsys):
    main(["--target", str(saved / "target"), "--head", str(saved / "head"), "--prompt", "w5 w6",
          "--max-new-tokens", "4", "--threads", "1"])
    assert "threads: 1 of" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--drafter", "ngram"], ["--drafter", "ngram", "--matches", "3", "--adaptive"],
                                   ["--drafter", "LM"], ["--drafter", "LM", "--adaptive"],
                                   ["--head", "HEAD", "--adaptive"], ["--drafter", "layer-skip"],
                                   ["--drafter", "layer-skip:1", "--adaptive"], ["--drafter", "LM+ngram"],
                                   ["--drafter", "LM+ngram", "--adaptive", "--tree", "chain6"],
                                   ["--head", "HEAD", "--lookup-first"], ["--head", "HEAD", "--lookup-first", "--adaptive"],
                                   ["--drafter", "head:HEAD+lookup-first"]])
def test_cli_classic_drafters(saved, capsys, extra):
    make_tiny_target("llama", num_layers=2, seed=4).save_pretrained(saved / "draft-lm")
    extra = [e.replace("LM", f"lm:{saved / 'draft-lm'}").replace("HEAD", str(saved / "head")) for e in extra]
    code = main(["--target", str(saved / "target"), "--prompt", "w7 w8 w9 w7 w8", "--max-new-tokens", "16",
                 *COMPARE, "--device", "cpu", *extra])
    assert code == 0
    assert "outputs identical: yes" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_cli_draft_lm_with_its_head(saved, capsys, kind):
    """--drafter lm:DIR+head:HEAD: a head trained on the draft LM guesses the draft LM's drafts; a head
    of another model is refused in one line naming both."""
    draft_lm = make_tiny_target("llama", num_layers=2, seed=4)
    draft_lm.save_pretrained(saved / "draft-lm")
    torch.manual_seed(0)
    build_head(kind, draft_lm).save_pretrained(saved / f"{kind}-of-draft-lm")
    base = ["--target", str(saved / "target"), "--prompt", "w7 w8 w9 w7 w8", "--max-new-tokens", "16", "--device", "cpu"]
    assert main([*base, "--drafter", f"lm:{saved / 'draft-lm'}+head:{saved / f'{kind}-of-draft-lm'}", *COMPARE]) == 0
    err = capsys.readouterr().err
    assert "outputs identical: yes" in err and "draft LM drafter + its head" in err
    with pytest.raises(ValueError, match="the inner level needs a head trained on the draft LM"):
        main([*base, "--drafter", f"lm:{saved / 'draft-lm'}+head:{saved / 'head'}"])


@pytest.mark.parametrize("spec", ["lm:", "lm:+ngram", "lm:+head:H", "lm:D+head:"])
def test_cli_draft_lm_spec_names_its_parts(spec, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--target", "T", "--drafter", spec, "--prompt", "w5"])
    assert err.value.code == 2 and "names no" in capsys.readouterr().err


def test_cli_lookup_first_needs_a_head(saved, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--target", str(saved / "target"), "--drafter", "ngram", "--lookup-first", "--prompt", "w5"])
    assert err.value.code == 2 and "--lookup-first puts prompt lookup before a head" in capsys.readouterr().err


def test_cli_early_exit_head_and_calibrated_layer_skip(saved, capsys, monkeypatch, tmp_path):
    """An early-exit head decodes from the CLI (a chain; --tree tree is refused with a line saying so);
    --drafter layer-skip says which k it took: half the layers, then the calibrated one."""
    from transformers import AutoModelForCausalLM

    from draftsmith.infer.drafters.free.layer_skip import calibration_path

    target = AutoModelForCausalLM.from_pretrained(saved / "target")
    torch.manual_seed(0)
    build_head("early-exit", target, exit_layer=2).save_pretrained(saved / "early-exit")
    base = ["--target", str(saved / "target"), "--prompt", "w7 w8 w9 w7 w8", "--max-new-tokens", "12", "--device", "cpu"]
    assert main([*base, "--head", str(saved / "early-exit"), *COMPARE]) == 0
    assert "outputs identical: yes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="early-exit heads draft chains only"):
        main([*base, "--head", str(saved / "early-exit"), "--tree", "tree"])
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert main([*base, "--drafter", "layer-skip"]) == 0
    assert "layer skip: k=3 (no calibration for this target" in capsys.readouterr().err
    path = calibration_path(target)
    path.parent.mkdir(parents=True)
    path.write_text('{"best_layers": 5}')
    assert main([*base, "--drafter", "layer-skip", *COMPARE]) == 0
    err = capsys.readouterr().err
    assert "layer skip: k=5 (calibrated)" in err and "outputs identical: yes" in err


def test_cli_bad_drafter_spec_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--target", "T", "--drafter", "bigram", "--prompt", "w5"])
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.value.code == 2 and "--drafter: drafter spec 'bigram': unknown drafter (use ngram, layer-skip[:K]" in message


def test_cli_needs_one_drafter(saved):
    with pytest.raises(SystemExit):
        main(["--target", str(saved / "target"), "--prompt", "w7", "--drafter", "ngram", "--head", str(saved / "head")])
    with pytest.raises(SystemExit):
        main(["--target", str(saved / "target"), "--prompt", "w7", "--drafter", "bigram"])
    with pytest.raises(SystemExit):
        main(["--target", str(saved / "target"), "--prompt", "w7", "--drafter", "layer-skip:0"])


def test_from_pretrained_follows_the_one_thread_policy(saved, capsys):
    from draftsmith.infer import SpeculativeGenerator

    SpeculativeGenerator.from_pretrained(str(saved / "target"), str(saved / "head"), device="cpu", threads=1)
    assert "threads: 1 of" in capsys.readouterr().err and torch.get_num_threads() == 1
    SpeculativeGenerator.from_pretrained(str(saved / "target"), str(saved / "head"), device="cpu")
    assert "(OMP_NUM_THREADS)" in capsys.readouterr().err  # the suite sets it; otherwise a probe decides


def test_compare_alternates_timed_rounds(saved, capsys, monkeypatch):
    """--compare times R decodes of each method, alternating, after the streamed one and the warm-ups."""
    calls = []
    spec_generate, hf_generate = SpeculativeGenerator.generate, LlamaForCausalLM.generate

    def spec(self, *args, **kwargs):
        calls.append(("spec", kwargs.get("max_new_tokens")))
        return spec_generate(self, *args, **kwargs)

    def hf(self, *args, **kwargs):
        calls.append(("hf", kwargs.get("max_new_tokens")))
        return hf_generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spec)
    monkeypatch.setattr(LlamaForCausalLM, "generate", hf)
    args = ["--target", str(saved / "target"), "--head", str(saved / "head"), "--prompt", "w7 w8 w9",
            "--max-new-tokens", "12", "--compare", "--device", "cpu"]
    assert main([*args, "--rounds", "2"]) == 0
    err = capsys.readouterr().err
    assert "over 2 rounds" in err and "2 rounds interleaved" in err and "outputs identical: yes" in err
    # warm-up, streamed, then the two methods alternating at the real size (the target's warm-up is 4 tokens)
    assert [c for c in calls if c != ("hf", 4)] == [("spec", 4), ("spec", 12), ("spec", 12), ("hf", 12), ("spec", 12),
                                                  ("hf", 12)]
    with pytest.raises(SystemExit):
        main([*args, "--rounds", "0"])
    assert "--rounds" in capsys.readouterr().err


def test_a_compiled_generator_warms_up_at_the_real_size(saved, capsys, monkeypatch):
    """A compiled step's shapes include the cache size: the warm-up decodes max_new_tokens, not 4 (no real
    compilation here: the compile function is replaced by the identity)."""
    import draftsmith.infer.drafters.base as drafter_base
    import draftsmith.infer.generator as generator

    monkeypatch.setattr(generator.SpeculativeGenerator, "_make_verify_fn",
                        staticmethod(lambda compile, device, target: generator.masked_forward))
    import draftsmith.infer.drafters.eagle as eagle

    for drafter in (drafter_base.Drafter, eagle.EagleDrafter):  # the EAGLE-3 head's drafter compiles its chain
        monkeypatch.setattr(drafter, "compile_with", lambda self, compile: None)
    sizes = []
    spec_generate = SpeculativeGenerator.generate

    def spec(self, *args, **kwargs):
        sizes.append((self.compile, kwargs.get("max_new_tokens")))
        return spec_generate(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeGenerator, "generate", spec)
    assert main(["--target", str(saved / "target"), "--head", str(saved / "head"), "--prompt", "w7 w8 w9",
                 "--max-new-tokens", "10", "--device", "cpu", "--compile"]) == 0
    assert sizes == [(True, 10), (True, 10)]
    err = capsys.readouterr().err  # what the silent minutes are, and how long they took
    assert "compiling the verify and draft steps (torch.compile, cpu" in err
    assert re.search(r"\ncompiled in \d+\.\d s \(the warm-up decode included\)\n", err)


def test_the_stream_shows_no_special_tokens(saved, tmp_path, capsys):
    """A target whose every logit ties picks token 0 (<pad>) each step: the streamed text must not print it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(saved / "target")
    with torch.no_grad():
        target.get_output_embeddings().weight.zero_()
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(saved / "target").save_pretrained(tmp_path / "target")
    assert main(["--target", str(tmp_path / "target"), "--head", str(saved / "head"), "--prompt", "w7 w8 w9",
                 "--max-new-tokens", "6", "--device", "cpu", "--compare", "--rounds", "1"]) == 0
    captured = capsys.readouterr()
    assert "outputs identical: yes" in captured.err
    assert "<pad>" not in captured.out and "<|im_end|>" not in captured.out


def test_cli_follows_the_plan_next_to_the_head_as_the_api_does(saved, tmp_path, capsys, monkeypatch):
    """``--head DIR`` reads DIR/speculation_plan.json as ``from_pretrained(target, DIR)`` does: a valid
    {"1": 0} is followed (the generator holds it: no drafting), a damaged plan is one line naming it."""
    import shutil

    from draftsmith.infer.generate_command import cli
    from draftsmith.infer.speculation_plan import SpeculationPlan

    made = []
    load = SpeculativeGenerator.from_pretrained.__func__
    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained",
                        classmethod(lambda cls, *a, **k: made.append(load(cls, *a, **k)) or made[-1]))

    head = tmp_path / "head"
    shutil.copytree(saved / "head", head)
    (head / "speculation_plan.json").write_text('{"lengths": {"1": 0}}')
    argv = ["--target", str(saved / "target"), "--head", str(head), "--prompt", "w7 w8 w9", "--max-new-tokens", "8",
            "--device", "cpu"]
    assert cli(argv) == 0
    assert made[-1].plan == SpeculationPlan({1: 0}) and "tau 1.00" in capsys.readouterr().err
    (head / "speculation_plan.json").write_text('{"lengths": {"1": ')
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "speculation_plan.json: not a speculation plan" in err


def test_the_cli_chooses_lengths_with_choose_and_adapts_them_by_default(saved, capsys, monkeypatch):
    """``--choose``: the chain whose length is chosen per step, printed with its choices; no flags: what
    ``SpeculativeGenerator(target, head)`` drafts on CPU, the adaptive chain, not the longest fixed chain
    (``fit_chain`` of no tree once made it a chain of 16: every sampled step drafted 16 levels)."""
    from draftsmith.infer.generate_command import cli
    from draftsmith.infer.drafters import CostAwareLength
    from draftsmith.infer.cost_profile import chooser_of

    from support.chooser import CHEAP

    made = []
    load = SpeculativeGenerator.from_pretrained.__func__

    def given_costs(cls, *a, **k):  # the costs given, not measured
        made.append(load(cls, *a, **k))
        if chooser_of(made[-1].drafter) is not None:
            chooser_of(made[-1].drafter).costs = CHEAP
        return made[-1]

    monkeypatch.setattr(SpeculativeGenerator, "from_pretrained", classmethod(given_costs))
    argv = ["--target", str(saved / "target"), "--head", str(saved / "head"), "--prompt", "w7 w8 w9",
            "--max-new-tokens", "8", "--device", "cpu"]
    assert cli(argv + ["--choose"]) == 0
    err = capsys.readouterr().err
    assert type(made[-1].drafter) is CostAwareLength and "drafted tokens per step" in err
    assert " 3:1" in err  # the prior's 3
    assert cli(argv) == 0 and "adaptive length" in capsys.readouterr().err
    assert cli(argv + ["--choose", "--tree", "dyn3-2-6"]) == 0  # a dynamic tree, its depth chosen
    assert made[-1].drafter.drafter.option == DynamicTree(3, 2, 6) and made[-1].drafter.maximum == 3
    assert " 5:1" in capsys.readouterr().err  # the prior's depth 3: 5 nodes
    for flags in (["--adaptive"], ["--tree", "chain3"]):
        assert cli(argv + ["--choose", *flags]) == 2
        assert "--choose chooses a chain's length or a dynamic tree's depth itself" in capsys.readouterr().err


def test_cli_defaults_fit_a_dflash_head_of_block_size_4(saved, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(saved / "target")
    build_head("dflash", target, block_size=4).save_pretrained(tmp_path / "head")
    argv = ["--target", str(saved / "target"), "--head", str(tmp_path / "head"), "--prompt", "w7 w8", "--max-new-tokens",
            "6", "--device", "cpu", *COMPARE]
    for flags in ([], ["--tree", "default"]):  # the CPU default chain of 4, cut to the head's 3
        assert main(argv + flags) == 0 and "outputs identical: yes" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"its chains: at most 3 drafts"):  # a length the user asked for is never cut
        main(argv + ["--tree", "chain4"])


def test_training_probes_threads_with_its_micro_batch_size(monkeypatch):
    """Training's thread probe is as tall as a micro-batch's tokens (capped): a decode-sized probe measured 1 and 2
    threads within 3% on an idle 2-core machine and kept 1, and the demo training took 6.5 minutes instead of 4."""
    import draftsmith.target.threads as threads
    from draftsmith.train import run

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    seen = []
    monkeypatch.setattr(threads, "probe_seconds", lambda n, give_up=None, rows=64: seen.append(rows) or 1.0 / n)
    before = torch.get_num_threads()
    try:
        run._choose_cpu_threads(2 * 100)
        run._choose_cpu_threads(4 * 256)
        run._choose_cpu_threads(64 * 4096)
    finally:
        torch.set_num_threads(before)
    assert seen == [200, 200, 1024, 1024, run.PROBE_ROWS_CAP, run.PROBE_ROWS_CAP], seen


def test_acceptance_flag_names_the_rule(monkeypatch):
    """--acceptance reaches the generator (traversal: docs/traversal.md); an unknown rule is refused by argparse."""
    from draftsmith.infer import generate_command

    args = generate_command.parse_args(["--head", "h", "--prompt", "x", "--acceptance", "traversal"])
    assert args.acceptance == "traversal"
    assert generate_command.parse_args(["--head", "h", "--prompt", "x"]).acceptance == "exact"
    with pytest.raises(SystemExit):
        generate_command.parse_args(["--head", "h", "--prompt", "x", "--acceptance", "sequence"])
