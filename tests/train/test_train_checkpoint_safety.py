"""Checkpoints hold no pickle and resuming never unpickles; a corrupt newest checkpoint is named and
the newest intact one is used instead; a fresh run never deletes an earlier run's checkpoints."""
from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.train.checkpoint import CheckpointError
from draftsmith.train.checkpoint import CHECKPOINTS
from draftsmith.train.run import setup
from draftsmith.train.resume import latest_checkpoint, mark_run

FAST = ["head.kind=medusa", "train.max_steps=4", "train.save_every=2", "train.eval_every=0", "data.eval=null",
        "train.warmup_steps=0", "train.keep_last_checkpoints=3"]


class _Payload:
    """Unpickling this touches ``path``: proof that a file was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _is_pickle(data: bytes) -> bool:
    return data[:1] == b"\x80" or data[:2] == b"PK"  # a pickle, or a torch.save zip (a pickle inside)


def test_checkpoints_hold_no_pickle(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *FAST))
    for checkpoint in (out / CHECKPOINTS).iterdir():
        for file in checkpoint.iterdir():
            assert file.suffix in (".json", ".safetensors") or file.name == "COMPLETE", file
            assert not _is_pickle(file.read_bytes()), f"{file} is a pickle"


def test_a_planted_pickle_does_not_run_on_resume(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *FAST))
    marker = tmp_path / "code-ran"
    latest = latest_checkpoint(out)
    for name in ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl", "optimizer.bin",
                 "scheduler.bin", "sampler.bin", "pytorch_model.bin"):
        (latest / name).write_bytes(pickle.dumps(_Payload(marker)))
    torch.save({"x": _Payload(marker)}, latest / "rng_state_0.pt")
    resumed = setup(tiny_config(tiny_files, out, *FAST[:1], "train.max_steps=6", "train.save_every=2",
                                "train.eval_every=0", "data.eval=null", "train.warmup_steps=0",
                                "resume_from=latest"))
    assert resumed.steps == 6
    assert not marker.exists(), "resuming unpickled a file of the checkpoint"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.safetensors", "rng_state_0.safetensors",
                                    "scheduler.json"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(tiny_files, tmp_path, caplog, victim):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *FAST))
    newest = latest_checkpoint(out)
    assert newest.name == "step-0000004"
    _truncate(newest / victim)
    mark_run(out)  # as if the run died after writing it: no completion record
    with pytest.raises(CheckpointError, match=rf"step-0000004/{victim}"):
        setup(tiny_config(tiny_files, out, *FAST, f"resume_from={newest}"))  # an explicit path: no fallback
    with caplog.at_level(logging.WARNING, logger="draftsmith.train"):
        resumed = setup(tiny_config(tiny_files, out, *FAST, "resume_from=latest"))
    assert resumed.steps == 4
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert victim in warning and "step-0000002" in warning


def test_a_fresh_run_refuses_to_delete_an_earlier_runs_checkpoints(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *FAST))
    before = sorted(p.name for p in (out / CHECKPOINTS).iterdir())
    with pytest.raises(ValueError, match=r"overwrite_output_dir=true.*resume_from=latest|resume_from=latest.*"
                                         r"overwrite_output_dir=true"):
        setup(tiny_config(tiny_files, out, *FAST))
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == before
    again = setup(tiny_config(tiny_files, out, *FAST, "overwrite_output_dir=true"))
    assert again.steps == 4


def test_an_accelerate_pickle_checkpoint_of_an_older_version_is_refused(tiny_files, tmp_path):
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *FAST))
    latest = latest_checkpoint(out)
    (latest / "COMPLETE").write_text(json.dumps({"step": 4}))  # the old marker: loop position only
    with pytest.raises(CheckpointError, match="pickle"):
        setup(tiny_config(tiny_files, out, *FAST, f"resume_from={latest}"))
