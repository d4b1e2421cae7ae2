"""train/train_head.py as a script: from any directory, --help, trackers, and a 2-process DDP run on CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support.train_fixtures import MAX_LENGTH, tiny_files  # noqa: F401  (fixture)
from support.train_script import SCRIPT, launch_two_processes, tiny_dict

from draftsmith.heads import AutoHead
from draftsmith.train.config import from_dict
from draftsmith.train.run import setup


def test_importing_the_entry_point_does_nothing():
    before = list(sys.path)
    import draftsmith.train.train_head as entry

    assert sys.path == before and callable(entry.cli)


def test_script_runs_from_another_directory(tmp_path, monkeypatch, capsys):
    run = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "head.draft_vocab_size" in run.stdout and "train.max_steps" in run.stdout
    # a config mistake exits 2 with one line: in-process (the script's process is --help's claim above, a
    # subprocess of ~10 s; under accelerate launch: test_config_errors_under_accelerate_launch_...)
    from draftsmith.train.train_head import cli

    monkeypatch.chdir(tmp_path)
    assert cli(["head.kind=gpt"]) == 2 and "head.kind: must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_two_process_ddp_on_cpu_matches_one_process_with_the_same_global_batch(tiny_files, tmp_path):
    """A 2-process DDP run on CPU (accelerate launch): it evaluates, checkpoints one RNG state per process and
    saves a loadable head; and 2 processes x 2 rows x 2 accumulation see the same 8 rows per step as
    1 process x 4 rows x 2 (one seeded shuffle, sharded by batch), so equal-length rows make the averaged losses
    and the weights equal too. (One launch for what were two tests; EAGLE-3's draft vocabulary under DDP:
    tests/train/test_target_sharding.py's whole-target run.)"""
    common = {"max_steps": 4, "grad_accum_steps": 2, "lr": 1e-2, "warmup_steps": 0, "eval_every": 2,
              "save_every": 2, "log_every": 1}
    ddp_out = tmp_path / "ddp"
    run = launch_two_processes(tiny_dict(tiny_files, ddp_out, head={"kind": "medusa", "num_heads": 2},
                                         train={**common, "micro_batch_size": 2}), tmp_path)
    assert "simulated tau" in run.stdout
    records = [json.loads(line) for line in (ddp_out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r and "tau" not in r]
    # every example is MAX_LENGTH tokens: 2 processes x 2 micro-batches x 2 rows per step
    assert train[0]["step"] == 1 and train[0]["tokens"] == 2 * 2 * 2 * MAX_LENGTH
    assert sorted((ddp_out / "checkpoints").iterdir())[-1].name == "step-0000004"
    assert {p.name for p in (ddp_out / "checkpoints" / "step-0000004").glob("rng_state_*")} == {
        "rng_state_0.safetensors", "rng_state_1.safetensors"}  # one per process, no pickle

    one = setup(from_dict(tiny_dict(tiny_files, tmp_path / "one", head={"kind": "medusa", "num_heads": 2},
                                    train={**common, "micro_batch_size": 4})))
    loaded = AutoHead.from_pretrained(ddp_out)
    assert loaded.head_kind == "medusa"
    ddp = loaded.state_dict()
    single = one.head.state_dict()
    assert ddp["blocks.0.layers.0.weight"].abs().sum() > 0  # trained away from the zero init
    for name, value in single.items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-4, atol=1e-6, msg=name)
    one_train = [r for r in one.history if "loss" in r and "tau" not in r]
    assert [r["step"] for r in train] == [r["step"] for r in one_train] == [1, 2, 3, 4]
    assert [r["loss"] for r in train] == pytest.approx([r["loss"] for r in one_train], rel=1e-5)


@pytest.mark.slow
def test_wandb_offline_and_tensorboard(tiny_files, tmp_path, monkeypatch):
    """In-process (``cli``, the script's function; its process is test_script_runs_from_another_directory's):
    a subprocess here spent ~10 s importing torch and transformers again."""
    from draftsmith.train.train_head import cli

    out = tmp_path / "tracked"
    args = [f"target={tiny_files['target']}", f"data.train={tiny_files['train']}", f"data.eval={tiny_files['eval']}",
            f"data.max_length={MAX_LENGTH}", "data.eval_rows=4", "train.max_steps=2", "train.warmup_steps=0",
            "train.log_every=1", "train.eval_every=2", "train.eval_decode_rows=2", "train.eval_decode_tokens=8",
            f"output_dir={out}",
            f"cache_dir={tmp_path / 'cache'}", "log.wandb=true", "log.tensorboard=true"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    medusa = SCRIPT.parents[1] / "configs" / "demo-medusa.yaml"
    assert cli(["--config", str(medusa), *args]) == 0
    import wandb

    assert wandb.run is None  # the run was finished: nothing of it is left to the tests after this one
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert list((out / "logs").rglob("events.out.tfevents.*"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # steps 1, 2 and the eval at 2


def test_config_errors_under_accelerate_launch_end_without_a_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["accelerate", "launch", "--cpu", "--num_processes", "1", "--mixed_precision", "no",
                          "--dynamo_backend", "no", str(SCRIPT), "head.kind=gpt"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr and "CalledProcessError" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith("config error: head.kind: must be one of")


def test_input_errors_and_divergence_are_one_line(tiny_files, tmp_path, capsys):
    from draftsmith.train.train_head import cli

    base = [f"target={tiny_files['target']}", f"data.eval={tiny_files['eval']}", f"cache_dir={tmp_path / 'c'}",
            "data.max_length=48", "train.max_steps=6", "train.eval_every=0", "train.warmup_steps=0",
            "train.micro_batch_size=4", "head.draft_vocab_size=null", "head.aux_layer_ids=null"]
    assert cli([*base, f"data.train={tmp_path / 'missing.jsonl'}", f"output_dir={tmp_path / 'a'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "missing.jsonl" in err[-1] and "Traceback" not in "".join(err)
    assert cli([*base, f"data.train={tiny_files['train']}", f"target={tmp_path / 'no-target'}",
                f"output_dir={tmp_path / 'b'}"]) == 2
    assert "no such directory" in capsys.readouterr().err.strip().splitlines()[-1]
    assert cli([*base, f"data.train={tiny_files['train']}", "train.lr=1e6", "train.warmup_steps=2",
                f"output_dir={tmp_path / 'c'}"]) == 1
    assert "training diverged" in capsys.readouterr().err.strip().splitlines()[-1]
