"""Config parsing: overrides, defaults filled at parse time, and errors that name the key."""
from __future__ import annotations

import re

import pytest

from draftsmith.train.config import ConfigError, help_text, load_config
from draftsmith.train.settings import DEFAULT_TTT_STEPS


def test_defaults_and_overrides():
    cfg = load_config(None, ["train.lr=3e-5", "head.aux_layer_ids=[1, 2, 3]", "data.eval=null",
                             "target=meta-llama/Llama-3.1-8B-Instruct", "train.betas=[0.8, 0.9]"])
    assert cfg.train.lr == 3e-5  # YAML 1.1 reads 3e-5 as a string; the float field converts it
    assert cfg.head.aux_layer_ids == [1, 2, 3]
    assert cfg.data.eval is None
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.head.ttt_steps == DEFAULT_TTT_STEPS  # eagle3 default filled at parse time
    assert cfg.output_dir == "runs/Llama-3.1-8B-Instruct-eagle3"


def test_kind_specific_defaults():
    assert load_config(None, ["head.kind=eagle"]).train.feature_noise == 0.1
    medusa = load_config(None, ["head.kind=medusa"])
    assert medusa.head.ttt_steps is None and medusa.train.feature_noise is None
    assert medusa.head.build_options() == {}
    assert load_config(None, ["head.kind=medusa", "head.num_heads=5"]).head.build_options() == {"num_heads": 5}


def test_yaml_file_and_later_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("head:\n  kind: medusa\ntrain:\n  max_steps: 10\n")
    cfg = load_config(path, ["train.max_steps=20"])
    assert (cfg.head.kind, cfg.train.max_steps) == ("medusa", 20)


@pytest.mark.parametrize("overrides, message", [
    (["head.foo=1"], "unknown config key 'head.foo'"),
    (["trian.lr=1e-4"], "unknown config key 'trian'"),
    (["head.kind=gpt"], "head.kind: must be one of medusa, eagle, eagle3"),
    (["train.lr=fast"], "train.lr: expected a number"),
    (["train.max_steps=1.5"], "train.max_steps: expected an integer"),
    (["data.strict=yes please"], "data.strict: expected true or false"),
    (["train.betas=[0.9]"], "train.betas: expected 2 values"),
    (["head=eagle3"], "head: expected a mapping"),
    (["head.kind=medusa", "head.draft_vocab_size=1000"], "head.draft_vocab_size applies only to head.kind=eagle3"),
    (["head.kind=medusa", "head.ttt_steps=3"], "head.ttt_steps applies only to head.kind=eagle3"),
    (["head.kind=eagle", "head.init_from_target=false"], "head.init_from_target applies only to head.kind=eagle3"),
    (["head.kind=eagle3", "head.num_heads=3"], "head.num_heads applies only to head.kind=medusa"),
    (["head.kind=eagle3", "train.feature_noise=0.2"], "train.feature_noise applies only to head.kind=eagle"),
    (["head.ttt_steps=0"], "head.ttt_steps must be >= 1"),
    (["head.draft_vocab_size=0"], "head.draft_vocab_size must be >= 1"),
    (["train.lr=0"], "train.lr must be > 0"),
    (["train.betas=[0.9, 1.0]"], "train.betas must lie in [0, 1)"),
    (["train.mixed_precision=fp8"], "train.mixed_precision: must be one of no, bf16, fp16"),
    (["head.aux_layer_ids=[-1, 2, 3]"], "head.aux_layer_ids [-1] are negative"),
    (["lr"], "not of the form key=value"),
    (["train.init_from="], "train.init_from: empty value in 'train.init_from='; write train.init_from=null"),
    (["head.kind=dflash", "head.aux_layer_ids=[0]"], "head.aux_layer_ids [0] are outside 1..L-1"),
    (["head.kind=dflash", "head.block_size=200", "data.max_length=128"],
     "head.block_size=200 exceeds data.max_length=128"),
])
def test_bad_configs_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("train:\n  max_step: 10\n")
    with pytest.raises(ConfigError, match="unknown config key 'train.max_step'"):
        load_config(typo)


def test_help_lists_every_key_with_its_default():
    text = help_text()
    assert "head.ttt_steps = null" in text and "train.betas = [0.9, 0.95]" in text
    assert "train.max_grad_norm = 0.5" in text


def test_overrides_may_come_before_and_after_config(tmp_path):
    from draftsmith.train.args import parse_args

    path = tmp_path / "c.yaml"
    path.write_text("head:\n  kind: medusa\ntrain:\n  lr: 0.01\n")
    cfg = parse_args(["train.max_steps=7", "--config", str(path), "train.lr=0.002"])
    assert (cfg.head.kind, cfg.train.max_steps, cfg.train.lr) == ("medusa", 7, 0.002)


def test_the_default_config_takes_any_head_kind_and_a_short_run(capsys):
    """A user who overrides one key of configs/demo.yaml needs no other file."""
    from draftsmith.train.args import parse_args
    from draftsmith.train.train_head import DEMO_CONFIG

    for kind in ("eagle", "medusa"):
        cfg = parse_args([f"head.kind={kind}"], default_config=DEMO_CONFIG)
        assert cfg.head.kind == kind and cfg.head.draft_vocab_size is None and cfg.head.aux_layer_ids is None
        note = capsys.readouterr().err
        assert note.count("\n") == 1 and "head.draft_vocab_size" in note and "eagle3" in note
        assert "train.labels (eagle3/mtp only)" in note and cfg.train.labels == "soft"  # the file's top-1 labels
    cfg = parse_args(["train.max_steps=5"], default_config=DEMO_CONFIG)  # its warm-up is 10 steps
    assert cfg.train.max_steps == 5
    with pytest.raises(ConfigError, match="head.draft_vocab_size applies only"):  # set by the user: refused
        parse_args(["head.kind=eagle", "head.draft_vocab_size=64"], default_config=DEMO_CONFIG)


VARIANTS = ("peagle", "dspark", "domino", "dflash2")  # every variant a kind declares (test below: all of them)


def test_the_variants_listed_are_every_variant():
    from draftsmith.heads.kinds import HEAD_CLASSES, VARIANT_CLASSES

    declared = {v for cls in HEAD_CLASSES.values() for v in getattr(cls.config_class, "variants", ())[1:]}
    assert declared == set(VARIANTS) and {v for _, v in VARIANT_CLASSES} <= declared


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_default_config_takes_a_variant_and_trains_a_step(variant, capsys):
    """``train_head.py head.variant=V`` with configs/demo.yaml: the file's keys the variant cannot take (P-EAGLE:
    EAGLE-3.1's norm_output; another kind's variant: the other kind's keys) are dropped with one line, and a step
    trains; such a key set by the user is refused."""
    import torch
    from support.targets import make_tiny_target

    from draftsmith.heads import build_head
    from draftsmith.train.args import parse_args
    from draftsmith.train.objectives import objective_class
    from draftsmith.train.train_head import DEMO_CONFIG

    small = ["head.block_size=4", "head.num_layers=1"] if variant != "peagle" else ["head.num_depths=3",
                                                                                "head.draft_vocab_size=64"]
    cfg = parse_args([f"head.variant={variant}", *small], default_config=DEMO_CONFIG)
    note = capsys.readouterr().err
    assert cfg.head.variant == variant and note.count("\n") == 1 and "head.norm_output" in note
    assert f"not read by head.kind={cfg.head.kind} head.variant={variant}" in note and cfg.head.norm_output is None
    target = make_tiny_target("llama", num_layers=8)
    head = build_head(cfg.head.kind, target, **cfg.head.build_options())
    objective = objective_class(cfg.head.kind, variant)(head, cfg)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    objective.perturb(features, cfg, seed=0)
    loss = objective(features, target.get_output_embeddings()).loss
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    with pytest.raises(ConfigError, match="fc_norm"):  # a key the variant cannot take, set by the user: refused
        parse_args([f"head.variant={variant}", *small, "head.fc_norm=true"], default_config=DEMO_CONFIG)


def test_help_shows_the_effective_defaults():
    from draftsmith.train.config import help_text
    from draftsmith.train.train_head import DEMO_CONFIG

    text = help_text(load_config(DEMO_CONFIG))
    assert "train.lr = 0.001" in text and "data.max_length = 256" in text and "train.max_steps = 300" in text and "data.self_distill.rows = 768" in text


@pytest.mark.parametrize("settings, message", [
    (["train.loss=ce", "train.dpace_alpha=0.3"], "train.dpace_alpha=0.3 is read only with train.loss=dpace "
                                                  "(train.loss=ce)"),
    (["head.kind=medusa", "train.anchors_per_document=8"], "train.anchors_per_document applies only to "
                                                            "head.kind=dflash or train.stage=on-policy"),
    (["head.kind=eagle3", "train.anchor_spacing=4"], "train.anchor_spacing applies only to head.kind=dflash or "
                                                      "train.stage=on-policy"),
])
def test_a_setting_no_part_of_the_run_reads_is_refused_from_the_command_line_and_a_file(tmp_path, settings, message):
    """They were ignored without a word on the command line (train.gamma on EAGLE-3 was already refused)."""
    import yaml

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, settings)
    tree: dict = {}
    for setting in settings:
        key, value = setting.split("=")
        tree.setdefault(key.split(".")[0], {})[key.split(".")[1]] = yaml.safe_load(value)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(tmp_path / "c.yaml")


def test_settings_read_where_they_apply_are_taken():
    assert load_config(None, ["train.loss=dpace", "train.dpace_alpha=0.3"]).train.dpace_alpha == 0.3
    assert load_config(None, ["head.kind=dflash", "train.anchors_per_document=8"]).train.anchors_per_document == 8
    stage = load_config(None, ["head.kind=eagle3", "train.stage=on-policy", "train.init_from=x",
                               "train.anchors_per_document=8"])  # the stage roots its chains at the anchors
    assert stage.train.anchors_per_document == 8


@pytest.mark.parametrize("setting, message", [
    ("head.mask_token_id=-1", "head.mask_token_id=-1 is outside the vocabulary 0..vocab_size-1 (the target's)"),
    ("head.selector_top_k=0", "the target's vocab_size"),
])
def test_the_parse_time_vocabulary_stands_in_messages_as_the_target_s(setting, message):
    extra = ["head.variant=dflash2"] if "selector" in setting else []
    with pytest.raises(ConfigError) as err:
        load_config(None, ["head.kind=dflash", *extra, setting])
    assert message in str(err.value) and "4611686018427387" not in str(err.value), str(err.value)


@pytest.mark.parametrize("setting", ["train.gamma=0", "train.dpace_alpha=2", "train.anchors_per_document=0",
                                     "train.backbone_lora_rank=-1", "train.max_steps=-1"])
def test_range_mistakes_are_found_before_torch_loads(tmp_path, setting):
    """train.gamma=0 took 20-45 s (it was checked after the head classes loaded torch), train.max_steps=-1 0.8 s:
    every check that needs no kind now runs first, so none of them imports torch."""
    import subprocess
    import sys

    probe = ("import sys\nfrom draftsmith.train.config import ConfigError, load_config\n"
             f"try:\n    load_config(None, [{setting!r}])\nexcept ConfigError as err:\n    print('refused:', err)\n"
             "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.splitlines()[-1] == "False" and done.stdout.startswith("refused:"), done.stdout + done.stderr
