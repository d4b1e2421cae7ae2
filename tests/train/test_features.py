"""Stored target features (issue 19): online, offline (scripts/dump_features.py + data.features) and
hybrid (data.feature_cache) training give the same losses; a dump killed with SIGKILL resumes with every
row stored exactly once; a folder made for another config is refused."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from support import train_fixtures
from safetensors import safe_open
from support.train_fixtures import tiny_config

import draftsmith.train.feature_source

from draftsmith import train
import draftsmith.train.objectives.base
from draftsmith import train
from draftsmith.data.feature_store import FeatureStoreError, decode, encode, open_store
from support.targets import make_tiny_target
from support.features import QUICK, config_file, losses
from draftsmith.scripts.dump_features import main as dump_main
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.feature_source import FeatureSource
from draftsmith.train.run import setup
from draftsmith.train.objectives import objective_class
from support.house import REPO as ROOT


def listed_rows(store) -> list[int]:
    """Every row of every listed shard of a feature ``store``, duplicates kept (a check that each row is there
    once)."""
    rows = []
    for name in sorted(store.known):
        with safe_open(str(store.path / name), "pt") as f:
            rows += f.get_tensor("row_ids").tolist()
    return rows


tiny_files = train_fixtures.tiny_files  # the fixture, used by name
KINDS = {
    "medusa": ["head.num_heads=3", "train.lr=1e-2"],
    "eagle": [],
    "eagle3": ["head.draft_vocab_size=128", "head.ttt_steps=3"],
    "dflash": ["head.block_size=4", "train.lr=1e-2"],
    "early-exit": ["head.exit_layer=2", "train.lr=1e-2"],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_online_offline_and_hybrid_training_give_the_same_losses(tiny_files, tmp_path, caplog, monkeypatch, kind):
    extra = [f"head.kind={kind}", *KINDS[kind], *QUICK]
    calls = []  # target forwards while training; eagle3 runs one more to choose its start (init_from_target)
    for module in (train.objectives.base, train.feature_source):
        real = module.target_forward
        monkeypatch.setattr(module, "target_forward", lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    probe = 1 if kind == "eagle3" else 0
    online = setup(tiny_config(tiny_files, tmp_path / "online", *extra))
    base = losses(online)
    assert len(base) == 12 and len(set(base)) > 1, base
    assert len(calls) == 12 + probe

    store = tmp_path / "features"
    cfg = tiny_config(tiny_files, tmp_path / "offline", *extra, f"data.features={store}")
    assert dump_main(["--config", str(config_file(cfg, tmp_path / "cfg.yaml")), "--out", str(store),
                      "--dtype", "float32", "data.features=null"]) == 0
    calls.clear()
    offline = setup(cfg)
    torch.testing.assert_close(losses(offline), base, rtol=0, atol=1e-4)
    assert len(calls) == probe

    cache = tmp_path / "cache-folder"
    caplog.set_level(logging.INFO, logger="draftsmith.train")
    calls.clear()
    hybrid = setup(tiny_config(tiny_files, tmp_path / "hybrid", *extra, f"data.feature_cache={cache}"))
    torch.testing.assert_close(losses(hybrid), base, rtol=0, atol=1e-4)
    assert len(calls) == 6 + probe
    # 12 steps over 6 micro-batches per epoch: the first epoch ran the target, the second read the cache
    assert "6 micro-batches read from stored features, 6 run through the target" in caplog.text
    rows = listed_rows(open_store(cache, json.loads((cache / ".draftsmith-features").read_text())["fingerprint"],
                                  key="data.feature_cache"))
    assert sorted(rows) == list(range(24))


def test_a_cache_stores_each_row_once_when_batches_mix_stored_and_new_rows(tmp_path):
    target = make_tiny_target("llama")
    store = open_store(tmp_path / "cache", {"target": "tiny"}, key="data.feature_cache", dtype="float32", create=True,
                       writer="rank0", shard_bytes=1)  # a shard per added row: stored rows are read at once
    source = FeatureSource(store, fill=True, key="data.feature_cache")
    medusa = objective_class("medusa")
    ids = torch.randint(3, 96, (4, 9), generator=torch.Generator().manual_seed(0))
    for rows in ([0, 1], [1, 2], [2, 2], [0, 1]):  # mixed, repeated (accelerate's padding), all stored
        batch = {"input_ids": ids[rows], "loss_mask": torch.ones(len(rows), 9, dtype=torch.long),
                 "lengths": torch.full((len(rows),), 9), "rows": torch.tensor(rows)}
        features = source.features(medusa, target, batch, None)
        torch.testing.assert_close(features.hidden, medusa.features(target, batch, None).hidden)
    source.close()
    assert sorted(listed_rows(store)) == [0, 1, 2]
    assert (source.online_batches, source.read_batches) == (2, 2)


def test_fp8_keeps_each_token_within_its_scale():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0])[:, None]
    stored = encode("final", x, "fp8")
    assert stored["final"].dtype == torch.float8_e4m3fn and stored["final_scale"].shape == (5,)
    back = decode(stored["final"], stored["final_scale"])
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 on normal values, per token whatever its size
    error = (back - x).abs() / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert error.max() <= 2 ** -4 and back[4].abs().max() == 0
    assert torch.equal(decode(*encode("final", x, "float32").values(), None), x)


def test_a_folder_made_for_another_config_or_holding_other_files_is_refused(tiny_files, tmp_path, capsys):
    store = tmp_path / "features"
    cfg_file = config_file(tiny_config(tiny_files, tmp_path / "run", "head.kind=medusa", *QUICK), tmp_path / "c.yaml")
    assert dump_main(["--config", str(cfg_file), "--out", str(store)]) == 0
    shards = sorted(p.name for p in store.iterdir())
    from draftsmith.data.entry_point import run

    assert run(dump_main, ["--config", str(cfg_file), "--out", str(store), "head.kind=eagle"]) == 2
    assert "head.kind='medusa' there, 'eagle' here" in capsys.readouterr().err
    assert run(dump_main, ["--config", str(cfg_file), "--out", str(store), "--dtype", "fp8"]) == 2
    assert "stores float32 (asked: fp8)" in capsys.readouterr().err
    assert sorted(p.name for p in store.iterdir()) == shards  # nothing changed
    with pytest.raises(FeatureStoreError, match="head.kind='medusa' there, 'eagle' here"):
        setup(tiny_config(tiny_files, tmp_path / "other", "head.kind=eagle", *QUICK, f"data.features={store}"))

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert run(dump_main, ["--config", str(cfg_file), "--out", str(mine)]) == 2
    assert "holds files no feature dump wrote (notes.txt)" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(None, [f"data.features={store}", f"data.feature_cache={mine}"])


def test_a_dump_killed_with_sigkill_resumes_with_every_row_exactly_once(tiny_files, tmp_path, capsys):
    lines = tiny_files["train"].read_text().splitlines()
    big = tmp_path / "big.jsonl"
    # 720 rows in about 35 shards: seconds to kill it mid-way after 3 (were 1440: the in-process resume dumped the
    # rest, twice the rows for the same proof)
    big.write_text("\n".join(lines * 30) + "\n")
    cfg = tiny_config(tiny_files, tmp_path / "run", "head.kind=eagle3", *QUICK, f"data.train={big}")
    cfg_file = config_file(cfg, tmp_path / "c.yaml")
    store = tmp_path / "features"
    command = [sys.executable, str(ROOT / "scripts" / "dump_features.py"), "--config", str(cfg_file),
               "--out", str(store), "--shard-mb", "0.5", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    manifest = store / "manifest-dump.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if manifest.is_file() and len(json.loads(manifest.read_text())["shards"]) >= 3:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    done = len(json.loads(manifest.read_text())["shards"])
    with pytest.raises(FeatureStoreError, match=r"holds \d+ of data.train's 720 rows: finish the dump"):
        setup(tiny_config(tiny_files, tmp_path / "early", "head.kind=eagle3", *QUICK, f"data.train={big}",
                          f"data.features={store}"))  # a killed dump is refused until it is finished
    # the resume in-process (the killed process above is the subprocess this test needs; a second is ~10 s)
    assert dump_main(command[2:]) == 0
    assert "rows already stored" in capsys.readouterr().err

    fingerprint = json.loads((store / ".draftsmith-features").read_text())["fingerprint"]
    features = open_store(store, fingerprint, key="data.features")
    rows = listed_rows(features)
    assert len(rows) == fingerprint["data.rows"] == 720 and sorted(rows) == list(range(720))
    assert len(json.loads(manifest.read_text())["shards"]) > done
    assert not list(store.glob(".*.tmp"))
    from draftsmith.train.examples import load_examples
    from transformers import AutoTokenizer

    examples, _ = load_examples(str(big), AutoTokenizer.from_pretrained(tiny_files["target"]), cfg, 300, "data.train")
    for row in (0, 377, 719):
        assert features.read([row])[0]["input_ids"].tolist() == examples[row]["input_ids"]


@pytest.mark.parametrize("overrides, message", [
    (["head.kind=medusa", "train.backbone_lora_rank=4", "data.features=/tmp/f"], "Medusa-2 trains the target"),
    (["head.kind=medusa", "train.backbone_lora_rank=4", "data.feature_cache=/tmp/f"], "stored ones are stale"),
    (["data.feature_cache=/tmp/f", "train.target_sharding=fsdp"], "skip the sharded target's collective forward"),
])
def test_stored_features_refuse_what_would_make_them_stale_or_hang(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def _small_store(path, fingerprint):
    """A folder of 2 rows (5 and 3 tokens; final (T, 8), aux (T, 16)) written by 'rank0'."""
    store = open_store(path, fingerprint, key="data.features", dtype="float32", create=True, writer="rank0")
    for row, length in ((0, 5), (2, 3)):
        store.add(row, torch.arange(length), torch.ones(length), {"final": torch.randn(length, 8),
                                                                   "aux": torch.randn(length, 16)})
    store.flush()
    return store


FINGERPRINT = {"target": "tiny", "target.hidden_size": 8, "aux_layer_ids": [1, 2], "data.rows": 3}


def test_a_shard_with_one_byte_changed_is_refused_when_read(tmp_path):
    """Same size, one byte flipped: the sha256 its manifest lists is checked before the first read."""
    _small_store(tmp_path / "f", FINGERPRINT)
    assert len(open_store(tmp_path / "f", FINGERPRINT, key="data.features").read([0, 2])) == 2
    shard = tmp_path / "f" / "rank0-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # inside the last stored state
    shard.write_bytes(bytes(data))
    store = open_store(tmp_path / "f", FINGERPRINT, key="data.features")
    with pytest.raises(FeatureStoreError, match=r"rank0-00000.safetensors: sha256 [0-9a-f]{16}\.\.\. differs from "
                                                r"the [0-9a-f]{16}\.\.\. listed in manifest-rank0.json"):
        store.read([2])


def test_a_cut_manifest_is_named(tmp_path):
    _small_store(tmp_path / "f", FINGERPRINT)
    manifest = tmp_path / "f" / "manifest-rank0.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(FeatureStoreError, match=r"manifest-rank0.json: not a feature manifest \(Expecting"):
        open_store(tmp_path / "f", FINGERPRINT, key="data.features")


@pytest.mark.parametrize("planted, message", [
    ({"data.rows": 2}, r"rank0-00000.safetensors: row_ids\[1\]=2 is outside \[0, 1\] \(the data's rows\)"),
    ({"target.hidden_size": 6}, r"rank0-00000.safetensors: aux has shape \[8, 16\]; the folder's target and "
                                r"tokens give \[8, 12\]"),
    ({"aux_layer_ids": [1, 2, 3]}, r"aux has shape \[8, 16\]; .* give \[8, 24\]"),
])
def test_a_shards_row_ids_and_shapes_are_checked_against_the_folders_target(tmp_path, planted, message):
    """The numbers a shard carries and the reader indexes with, checked when it is indexed: a folder
    whose fingerprint (the target and data it is used for) disagrees with its shards is refused."""
    _small_store(tmp_path / "f", FINGERPRINT)
    fingerprint = {**FINGERPRINT, **planted}
    marker = tmp_path / "f" / ".draftsmith-features"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "fingerprint": fingerprint}))
    with pytest.raises(FeatureStoreError, match=message):
        open_store(tmp_path / "f", fingerprint, key="data.features")
