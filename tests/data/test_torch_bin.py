"""pytorch_model.bin files are read without unpickling (data.base.torch_bin)."""
from __future__ import annotations

import collections
import zipfile

import pytest
import torch

from draftsmith.data.base.torch_bin import read_torch_bin
from support.house import LAYERS, REPO


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4, generator=g)
    return collections.OrderedDict(
        weight=base,
        transposed=base.t(),  # strided view: same storage, other strides
        row=base[1],  # view with an offset
        half=torch.randn(5, generator=g).half(), bf16=torch.randn(2, 2, generator=g).bfloat16(),
        ids=torch.arange(7), flags=torch.tensor([True, False]), small=torch.tensor([1, -2], dtype=torch.int8),
        empty=torch.zeros(0, 3), scalar=torch.tensor(2.5, dtype=torch.float64),
    )


@pytest.mark.parametrize("ordered", [True, False])
def test_reads_what_torch_load_reads(tmp_path, ordered):
    state = _state() if ordered else dict(_state())
    torch.save(state, tmp_path / "pytorch_model.bin")
    mine = read_torch_bin(tmp_path / "pytorch_model.bin")
    ref = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)  # the reference reader, in the test only
    assert list(mine) == list(ref)
    for key in ref:
        assert mine[key].dtype == ref[key].dtype and mine[key].shape == ref[key].shape, key
        assert mine[key].stride() == ref[key].stride(), key
        assert torch.equal(mine[key], ref[key]), key


def test_never_unpickles(tmp_path, monkeypatch):
    """A pickle naming any callable is refused before anything runs (torch.load is never called)."""
    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("ran",))

    torch.save({"x": torch.ones(1), "y": Payload()}, tmp_path / "evil.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(ValueError, match=r"evil.bin: not a plain state dict of tensors \(it names __builtin__\.getattr"):
        read_torch_bin(tmp_path / "evil.bin")
    assert ran == []


def test_refuses_other_content(tmp_path):
    torch.save({"x": torch.ones(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy.bin: not a zip archive"):
        read_torch_bin(tmp_path / "legacy.bin")
    torch.save({"x": torch.ones(2), "n": 3}, tmp_path / "mixed.bin")
    with pytest.raises(ValueError, match="mixed.bin: not a plain state dict of tensors"):
        read_torch_bin(tmp_path / "mixed.bin")
    torch.save([torch.ones(2)], tmp_path / "list.bin")
    with pytest.raises(ValueError, match="list.bin: not a plain state dict of tensors"):
        read_torch_bin(tmp_path / "list.bin")


def test_truncated_storage_is_named(tmp_path):
    torch.save({"x": torch.ones(4)}, tmp_path / "a.bin")
    with zipfile.ZipFile(tmp_path / "a.bin") as src, zipfile.ZipFile(tmp_path / "cut.bin", "w") as dst:
        for name in src.namelist():
            data = src.read(name)
            dst.writestr(name, data[:-4] if name.endswith("/data/0") else data)
    with pytest.raises(ValueError, match=r"cut.bin: .*storage 0 holds 12 bytes, not 4 × 4"):
        read_torch_bin(tmp_path / "cut.bin")


def test_no_library_module_unpickles():
    """Nothing in the library's folders (data/ ... scripts/) calls an unpickler."""
    import re

    root = REPO
    calls = re.compile(r"\b(torch\.load|pickle\.loads?|dill\.loads?|cloudpickle\.loads?|joblib\.load)\(")
    found = [f"{p.relative_to(root)}:{i}" for folder in LAYERS
             for p in sorted((root / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert found == []
