"""The range principle: a number a file carries and the code uses as an index is checked against the
model it will index when the file is loaded, in one line naming the file, the field and the allowed
range. Each loader gets a planted out-of-range value here, or in the test named beside it:

- heads (every kind): this file; their import formats: tests/heads/test_dflash_formats.py (target_layer_ids),
  test_eagle3_import_refuses_a_d2t_outside_the_vocabulary here;
- PEFT adapters (layers_to_transform) and a checkpoint's loop position (resume): this file;
- stored features (row ids, offsets, state shapes): tests/train/test_features.py;
- speculation plans (batch sizes, draft lengths): tests/infer/test_infer_plan.py; layer-skip calibration
  (best_layers): tests/infer/test_infer_selfspec.py; configs (aux ids, block size): tests/train/test_train_config.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from safetensors.torch import load_file, save_file

from draftsmith.data.base.checks import at_most, index, indices
from draftsmith.heads import AutoHead, build_head

L, V = 8, 96


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", num_layers=L)


def _saved(tmp_path, target, kind, **options):
    head = build_head(kind, target, **options)
    head.save_pretrained(tmp_path / kind)
    return tmp_path / kind


def _edit_config(directory, **fields):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_the_shared_checks_name_file_field_and_range():
    assert index("k", 3, 4) == 3 and indices("ids", torch.tensor([0, 3]), 4) == [0, 3] and at_most("n", 4, 4) == 4
    with pytest.raises(ValueError, match=r"^f.json: k=4 is outside \[0, 3\] \(the 4 rows\)$"):
        index("k", 4, 4, "f.json", "the 4 rows")
    with pytest.raises(ValueError, match=r"^ids\[1\]=-1 is outside \[0, 3\]$"):
        indices("ids", [0, -1], 4)
    with pytest.raises(ValueError, match=r"^f: n=5 exceeds the context=4$"):
        at_most("n", 5, 4, "f", "the context")
    with pytest.raises(ValueError, match=r"k=1.0 is outside"):  # no float indexes
        index("k", 1.0, 4)


def test_eagle3_d2t_outside_the_vocabulary_is_refused_on_load(tmp_path, target):
    directory = _saved(tmp_path, target, "eagle3", draft_vocab_size=32)
    weights = load_file(directory / "model.safetensors")
    weights["d2t"][5] = V  # draft id 5 -> target id 101
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"eagle3: d2t\[5\]={V} maps draft id 5 to target id {V + 5}, outside "
                                         rf"\[0, {V - 1}\]"):
        AutoHead.from_pretrained(directory)


def test_eagle3_t2d_that_disagrees_with_d2t_is_refused_on_load(tmp_path, target):
    directory = _saved(tmp_path, target, "eagle3", draft_vocab_size=32)
    weights = load_file(directory / "model.safetensors")
    weights["t2d"][:] = False
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="eagle3: t2d marks 0 tokens, not the 32 target ids d2t reaches"):
        AutoHead.from_pretrained(directory)


@pytest.mark.parametrize("kind, fields, message", [
    ("eagle3", {"aux_layer_ids": [2, 4, L]}, rf"aux_layer_ids \[{L}\] are outside the target's layers 0..{L - 1}"),
    ("dflash", {"aux_layer_ids": [0, 3]}, r"aux_layer_ids \[0\] are outside 1..7"),
    ("dflash", {"mask_token_id": V}, rf"mask_token_id={V} is outside the vocabulary 0..{V - 1}"),
    ("dflash", {"block_size": 1}, r"block_size=1: a DFlash block needs the root and at least one mask"),
    ("early-exit", {"exit_layer": L}, rf"exit_layer must lie in \[1, {L} - 1\]"),
])
def test_a_heads_config_index_outside_its_target_is_refused_naming_the_file(tmp_path, target, kind, fields, message):
    directory = _saved(tmp_path, target, kind)
    _edit_config(directory, **fields)
    with pytest.raises(ValueError, match=rf"{kind}(/config.json)?: .*{message}"):
        AutoHead.from_pretrained(directory)


def test_eagle3_import_refuses_a_d2t_outside_the_vocabulary(tmp_path, target):
    from draftsmith.heads.formats import export_head

    head = build_head("eagle3", target, draft_vocab_size=32)
    export_head(head, tmp_path / "exported", "vllm")
    weights = load_file(tmp_path / "exported" / "model.safetensors")
    weights["d2t"][-1] = V  # the last draft id past the vocabulary
    save_file(weights, tmp_path / "exported" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"d2t: target ids span 0..{V + 31}, outside \[0, {V}\)"):
        AutoHead.from_pretrained(tmp_path / "exported")


def test_a_resumed_data_position_past_the_epoch_is_refused():
    """A checkpoint's loop position indexes the epoch's micro-batches: past them the whole epoch was skipped."""
    from torch.utils.data import DataLoader

    from draftsmith.train.fit import _micro_batches
    from draftsmith.train.resume import TrainState

    loader = DataLoader(list(range(4)), batch_size=2)  # 2 micro-batches per epoch
    with pytest.raises(ValueError, match=r"data position batch=3 is outside \[0, 2\]"):
        next(_micro_batches(None, loader, TrainState(batch=3)))


def test_an_adapters_layers_to_transform_past_its_base_is_refused(tmp_path):
    from support.peft_targets import save_adapter

    from draftsmith.data.targets import load_target

    adapter_dir, _ = save_adapter(make_tiny_target("llama"), tmp_path)  # a 6-layer base
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (adapter_dir / "adapter_config.json").write_text(json.dumps({**config, "layers_to_transform": [1, 6]}))
    with pytest.raises(ValueError, match=r"adapter_config.json: layers_to_transform\[1\]=6 is outside \[0, 5\] "
                                         r"\(the base model's 6 layers\)"):
        load_target(str(adapter_dir))
