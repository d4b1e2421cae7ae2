"""Data sources a user can name in data.train / data.eval: a `datasets` folder from save_to_disk works,
and a directory that is not one is refused naming what it must contain."""
from __future__ import annotations

import datasets
import pytest
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)
from transformers import AutoTokenizer

from draftsmith.data.pipeline import build_examples, load_rows
from draftsmith.train.run import setup

ROWS = [{"text": "def f(x):\n    return x + 1\n" * 3}, {"text": "class A:\n    pass\n" * 4}]


def test_a_save_to_disk_folder_is_a_source(tmp_path, tiny_files):
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    assert [r["text"] for r in load_rows(str(folder))] == [r["text"] for r in ROWS]
    tokenizer = AutoTokenizer.from_pretrained(tiny_files["target"])
    examples, summary = build_examples(str(folder), tokenizer, max_length=32, cache_dir=tmp_path / "cache")
    assert len(examples) == 2 and summary.rows_in == 2
    datasets.Dataset.from_list(ROWS[:1]).save_to_disk(str(tmp_path / "ds2"))  # other content: other cache key
    again, _ = build_examples(str(tmp_path / "ds2"), tokenizer, max_length=32, cache_dir=tmp_path / "cache")
    assert len(again) == 1


def test_training_reads_a_save_to_disk_folder(tmp_path, tiny_files):
    rows = [{"text": line} for line in tiny_files["train"].read_text().splitlines()]
    folder = tmp_path / "train-ds"
    datasets.Dataset.from_json(str(tiny_files["train"])).save_to_disk(str(folder))
    assert len(rows) == 24
    result = setup(tiny_config(tiny_files, tmp_path / "out", f"data.train={folder}", "head.kind=medusa",
                               "train.max_steps=2", "train.warmup_steps=0", "train.eval_every=0", "data.eval=null"))
    assert result.steps == 2


def test_a_dataset_dict_folder_names_its_splits(tmp_path):
    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(folder))
    with pytest.raises(ValueError, match=r"splits \['train'\].*dd/train"):
        load_rows(str(folder))


def test_a_plain_directory_says_what_it_must_contain(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="save_to_disk"):
        load_rows(str(tmp_path / "plain"))
