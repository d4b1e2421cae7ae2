"""``draftsmith stitch``: export -> stitch -> ``head.init=native`` from the stitched copy gives the head's tensors
back bit for bit; the copy loads in transformers as the same target (equal logits); the user's folder is left
byte for byte; a one-file checkpoint becomes sharded with an index; every refusal is one line naming the path."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from support.formats import perturb
from support.mtp_targets import STYLES, make_mtp_target, tuned_export
from transformers import AutoModelForCausalLM

from draftsmith.heads import build_head
from draftsmith.heads.formats import export_head
from draftsmith.heads.mtp_native import native_state_dict
from draftsmith.heads.mtp_stitch import MTP_SHARD, TRUNK_SHARD, stitch
from draftsmith.scripts.stitch import cli

PROMPT = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])


@pytest.fixture(scope="module", params=STYLES)
def made(request, tmp_path_factory):
    """(target, a tuned head (perturbed: not the checkpoint's), its export)."""
    return tuned_export(request.param, tmp_path_factory.mktemp(request.param))


def _hashes(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _load(folder):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().eval()


def _index_is_whole(folder) -> dict[str, str]:
    """The index names every safetensors file of ``folder`` and every tensor in it, each once (an engine that
    globs ``*.safetensors`` finds no stale MTP tensors)."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    on_disk = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert name not in on_disk, (name, path.name, on_disk[name])
                on_disk[name] = path.name
    assert on_disk == index
    return index


def _native_is(head, folder) -> None:
    """``head.init=native`` from ``folder`` gives ``head``'s tensors, in the family's names and in the head's."""
    again = build_head("mtp", _load(folder))
    want, got = native_state_dict(head), native_state_dict(again)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), head.state_dict().values()))


@pytest.mark.parametrize("source", ["export", "head"])
def test_stitched_copy_gives_the_head_back_and_is_the_same_target(made, source, tmp_path):
    t, head, export = made
    before = _hashes(t.folder)
    if source == "head":
        head.save_pretrained(tmp_path / "head")
    out = stitch(str(export if source == "export" else tmp_path / "head"), t.folder, tmp_path / "stitched")
    assert _hashes(t.folder) == before  # the user's folder: every byte as it was
    _native_is(head, out)
    with torch.no_grad():
        assert torch.equal(_load(out)(PROMPT).logits, t.model(PROMPT).logits)
    index = _index_is_whole(out)
    assert {k for k, f in index.items() if f == MTP_SHARD} == set(native_state_dict(head)) | (
        {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}
        if head.config.style == "deepseek" else set())
    assert "model-00002-of-00002.safetensors" not in index.values()  # the old MTP shard held nothing else


def test_a_one_file_checkpoint_becomes_sharded(made, tmp_path):
    """transformers' save_pretrained drops the MTP tensors: the stitch puts them back beside the trunk."""
    t, head, export = made
    t.model.save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved" / "model.safetensors.index.json").exists()
    out = stitch(str(export), tmp_path / "resaved", tmp_path / "stitched")
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted([MTP_SHARD, TRUNK_SHARD])
    assert set(_index_is_whole(out).values()) == {MTP_SHARD, TRUNK_SHARD}
    _native_is(head, out)
    with torch.no_grad():
        assert torch.equal(_load(out)(PROMPT).logits, t.model(PROMPT).logits)


def test_overwrite_replaces_only_an_earlier_stitch(made, tmp_path):
    t, _, export = made
    stitch(str(export), t.folder, tmp_path / "stitched")
    assert cli([str(export), str(t.folder), str(tmp_path / "stitched"), "--overwrite"]) == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    assert cli([str(export), str(t.folder), str(tmp_path / "mine"), "--overwrite"]) == 2
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def _refusal(capsys, args) -> str:
    assert cli([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_refusals_are_one_line_naming_the_path(made, tmp_path, capsys):
    t, _, export = made
    before = _hashes(t.folder)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert f"{tmp_path / 'full'} exists and is not empty" in _refusal(capsys, [export, t.folder, tmp_path / "full"])
    assert "no .draftsmith-stitch" in _refusal(capsys, [export, t.folder, tmp_path / "full", "--overwrite"])
    assert f"it is, lies inside or contains the target folder {t.folder}" in _refusal(
        capsys, [export, t.folder, t.folder / "inside"])
    assert "contains the target folder" in _refusal(capsys, [export, t.folder, t.folder.parent, "--overwrite"])
    assert f"{tmp_path / 'nothing'}: not a model folder (no config.json)" in _refusal(
        capsys, [export, tmp_path / "nothing", tmp_path / "out"])
    assert _hashes(t.folder) == before


def test_an_export_for_another_layout_is_refused(made, tmp_path, capsys):
    t, head, export = made
    other = "qwen3_next" if head.config.style == "deepseek" else "deepseek"
    elsewhere = make_mtp_target(other, tmp_path / "other")
    line = _refusal(capsys, [export, elsewhere.folder, tmp_path / "out"])
    assert line.startswith(f"error: {export}: 1 MTP layer(s) in the {head.config.style} layout") and other in line
    assert not (tmp_path / "out").exists()


def test_two_mtp_layers_go_back_bit_for_bit(tmp_path):
    """Both layers under their own names (model.layers.2.*, model.layers.3.*), each with its carried copies."""
    from support.mtp_layers import make_layers_target

    t = make_layers_target(tmp_path / "target")
    head = perturb(build_head("mtp", t.model))
    export = export_head(head, tmp_path / "export", "mtp", target=t.model)
    before = _hashes(t.folder)
    out = stitch(str(export), t.folder, tmp_path / "stitched")
    assert _hashes(t.folder) == before
    index = _index_is_whole(out)
    assert {"model.layers.3.enorm.weight", "model.layers.3.shared_head.head.weight"} <= set(index)
    _native_is(head, out)


def test_transformers_own_mtp_decoding_reads_the_stitched_layer(tmp_path):
    """Mellum (the family whose MTP layers transformers' ``generate(use_mtp=True)`` finds through its config):
    transformers' ``MtpModel.from_pretrained`` on the stitched copy loads the tuned head's tensors, not the
    target's own, and its MTP decoding of the copy is the copy's greedy text."""
    from transformers.modeling_layers import MtpModel

    t = make_mtp_target("mellum", tmp_path / "target", vocab=8, sharpen=4.0)
    head = perturb(build_head("mtp", t.model))
    export = export_head(head, tmp_path / "export", "mtp", target=t.model)
    out = stitch(str(export), t.folder, tmp_path / "copy")
    copy, original = _load(out), _load(t.folder)
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        exported = [f.get_tensor(k) for k in f.keys()]
    mine = {k: v for k, v in MtpModel.from_pretrained(copy).state_dict().items()  # the layer's own (experts merged)
            if not any(part in k for part in ("embed", "shared_head", "experts"))}
    theirs = MtpModel.from_pretrained(original).state_dict()
    assert mine and any(not torch.equal(v, theirs[k]) for k, v in mine.items())  # the tuned layer, not the original
    assert all(any(v.shape == e.shape and torch.equal(v, e) for e in exported) for v in mine.values())  # the export's
    again = build_head("mtp", copy)  # head.init=native: the same tensors transformers read
    assert all(torch.equal(v, native_state_dict(again)[k]) for k, v in native_state_dict(head).items())
    want = copy.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(copy.generate(PROMPT, max_new_tokens=16, do_sample=False, use_mtp=True), want)
