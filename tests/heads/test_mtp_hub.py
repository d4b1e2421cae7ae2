"""``head.init=native`` for a target loaded by Hub id: the download is asked for the index file and the shards
holding MTP tensors only, and the head is the one a local folder gives. The Hub is out of reach here: only the
download function is replaced, by a copy from a local folder that records what it was asked for."""
from __future__ import annotations

import fnmatch
import shutil

import pytest
import torch
from support.mtp_targets import STYLES, make_mtp_target

from draftsmith.heads import build_head
from draftsmith.heads import mtp_hub

REPO = "org/tiny-mtp"


@pytest.fixture(scope="module", params=STYLES)
def mtp_target(request, tmp_path_factory):
    return make_mtp_target(request.param, tmp_path_factory.mktemp(request.param) / "target")


def fake_hub(monkeypatch, folder, cache):
    """``snapshot_download`` from ``folder``: copies the files ``allow_patterns`` match into ``cache``; returns
    the list of calls' patterns."""
    asked = []

    def snapshot_download(repo_id, allow_patterns=None, revision=None):
        assert repo_id == REPO
        asked.append(list(allow_patterns))
        cache.mkdir(exist_ok=True)
        for path in folder.iterdir():
            if any(fnmatch.fnmatch(path.name, p) for p in allow_patterns):
                shutil.copy2(path, cache / path.name)
        return str(cache)

    monkeypatch.setattr(mtp_hub, "snapshot_download", snapshot_download)
    return asked


def test_only_the_index_and_the_mtp_shard_are_downloaded(mtp_target, monkeypatch, tmp_path):
    local = build_head("mtp", mtp_target.model)
    asked = fake_hub(monkeypatch, mtp_target.folder, tmp_path / "cache")
    monkeypatch.setattr(mtp_target.model.config, "_name_or_path", REPO)
    head = build_head("mtp", mtp_target.model)
    index = "model.safetensors.index.json"
    assert asked == [[index], [index, "model-00002-of-00002.safetensors"]]
    assert not (tmp_path / "cache" / "model-00001-of-00002.safetensors").exists()
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), local.state_dict().values()))


def test_an_index_without_mtp_tensors_is_refused(mtp_target, monkeypatch, tmp_path):
    mtp_target.model.save_pretrained(tmp_path / "resaved", max_shard_size="20KB")  # sharded, MTP tensors dropped
    asked = fake_hub(monkeypatch, tmp_path / "resaved", tmp_path / "cache")
    monkeypatch.setattr(mtp_target.model.config, "_name_or_path", REPO)
    with pytest.raises(ValueError, match=rf"^head.init=native: {REPO}'s model.safetensors.index.json maps no MTP "
                                         "tensor; the checkpoint was published without its MTP layers$"):
        build_head("mtp", mtp_target.model)
    assert asked == [["model.safetensors.index.json"]]


def test_a_name_that_is_neither_folder_nor_hub_id_is_refused(mtp_target, monkeypatch):
    monkeypatch.setattr(mtp_target.model.config, "_name_or_path", "./gone/target")
    with pytest.raises(ValueError, match=r"^head.init=native reads the MTP tensors from the target's checkpoint; "
                                         r"\./gone/target is neither a local folder nor a Hub id$"):
        build_head("mtp", mtp_target.model)
