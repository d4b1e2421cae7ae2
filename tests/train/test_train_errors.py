"""Bad data, mismatched targets and impossible settings fail before training, naming the problem."""
from __future__ import annotations

import json

import pytest
from support.train_fixtures import save_tiny_target, tiny_config, tiny_files  # noqa: F401  (fixture)
from transformers import AutoTokenizer

from draftsmith.train.run import setup


def test_data_without_usable_rows(tiny_files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "no known field"}) + "\n" + json.dumps({"text": "   "}) + "\n")
    with pytest.raises(ValueError, match=r"data.train=.*bad.jsonl.*: no examples(.|\n)*missing_field"):
        setup(tiny_config(tiny_files, tmp_path / "out", f"data.train={bad}"))


def test_strict_data_raises_at_the_first_bad_row(tiny_files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine text " * 10}) + "\n" + json.dumps({"messages": "oops"}) + "\n")
    with pytest.raises(ValueError, match="data.train=.*row 1: bad_structure"):
        setup(tiny_config(tiny_files, tmp_path / "out", f"data.train={bad}", "data.strict=true"))


def test_missing_data_file(tiny_files, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        setup(tiny_config(tiny_files, tmp_path / "out", f"data.train={tmp_path / 'nope.jsonl'}"))


def test_tokenizer_of_another_target_is_refused(tiny_files, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_files["target"])
    mismatched = tmp_path / "mismatched"
    save_tiny_target(mismatched, tokenizer)  # a 300-token model ...
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(20)])
    tokenizer.save_pretrained(mismatched)  # ... next to a 320-token tokenizer
    with pytest.raises(ValueError, match="has 320 tokens, more than the target's vocab_size=300"):
        setup(tiny_config(tiny_files, tmp_path / "out", f"target={mismatched}"))


@pytest.mark.parametrize("override, message", [
    ("data.max_length=512", "data.max_length=512 exceeds the target's max_position_embeddings=128"),
    ("head.draft_vocab_size=5000", "head.draft_vocab_size=5000 exceeds the target's vocab_size=300"),
    ("head.aux_layer_ids=[1, 2, 9]", r"aux_layer_ids \[9\] are outside the target's layers"),
    ("resume_from=latest", "resume_from=latest: no complete checkpoint"),
])
def test_settings_that_do_not_fit_the_target(tiny_files, tmp_path, override, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        setup(tiny_config(tiny_files, tmp_path / "out", override))


def test_medusa_eval_depth_beyond_its_heads(tiny_files, tmp_path):
    with pytest.raises(ValueError, match="train.eval_depth=6 exceeds the Medusa head's num_heads=4"):
        setup(tiny_config(tiny_files, tmp_path / "out", "head.kind=medusa", "train.eval_depth=6"))


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_an_encoder_target_is_refused_alike_for_every_kind(tiny_files, tmp_path, kind):
    from transformers import BertConfig, BertLMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_files["target"])
    bert = BertLMHeadModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64, is_decoder=True))
    bert.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="only decoder-only"):
        setup(tiny_config(tiny_files, tmp_path / "out", f"target={tmp_path / 'bert'}", f"head.kind={kind}"))


@pytest.mark.parametrize("ids, message", [
    ("[2,2,2]", "repeats"),
    ("[2,4]", "exactly 3"),
    ("[1,2,3,4]", "exactly 3"),
])
def test_aux_layer_ids_the_engines_cannot_load_are_refused_at_parse_time(tiny_files, tmp_path, ids, message):
    from draftsmith.train.config import ConfigError

    with pytest.raises(ConfigError, match=rf"head.aux_layer_ids.*{message}"):
        tiny_config(tiny_files, tmp_path / "out", f"head.aux_layer_ids={ids}")


def test_default_aux_layers_are_three_distinct_valid_layers_or_refused():
    from draftsmith.heads import default_aux_layer_ids
    from draftsmith.heads.eagle3 import Eagle3Config

    for layers in range(3, 40):
        ids = default_aux_layer_ids(layers)
        assert len(set(ids)) == 3 and all(0 <= i < layers for i in ids), (layers, ids)
    assert default_aux_layer_ids(32) == [2, 16, 29]  # the engines' own rule where it is valid
    with pytest.raises(ValueError, match="fewer than 3"):
        default_aux_layer_ids(2)
    with pytest.raises(ValueError, match="repeats"):
        Eagle3Config(aux_layer_ids=[2, 2, 3], target_num_layers=8, vocab_size=10)


def test_warm_up_longer_than_the_run_is_capped(tiny_files, tmp_path):
    result = setup(tiny_config(tiny_files, tmp_path / "out", "head.kind=medusa", "train.max_steps=3",
                               "train.warmup_steps=10", "train.eval_every=0", "data.eval=null", "train.log_every=1"))
    lrs = [r["lr"] for r in result.history if "lr" in r]
    assert result.steps == 3 and lrs == sorted(lrs) and lrs[-1] == pytest.approx(3e-3)  # peak at the last step
