"""train.target_sharding=fsdp: the frozen target's decoder layers sharded over 2 CPU processes (FSDP2 on
gloo) train the head to the same losses and held-out metrics as a whole target in every process."""
from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)
from support.train_script import launch_two_processes, tiny_dict

from draftsmith.heads import AutoHead
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.target_sharding import is_sharded, shard_target
from support.house import REPO


def test_target_sharding_key_is_checked(tiny_files, tmp_path):
    assert tiny_config(tiny_files, tmp_path / "a").train.target_sharding == "none"
    assert tiny_config(tiny_files, tmp_path / "b", "train.target_sharding=fsdp").train.target_sharding == "fsdp"
    with pytest.raises(ConfigError, match="train.target_sharding: must be one of none, fsdp"):
        tiny_config(tiny_files, tmp_path / "c", "train.target_sharding=zero3")


def test_one_process_keeps_the_target_whole():
    from support.targets import make_tiny_target

    target = make_tiny_target("llama")
    assert shard_target(target, Accelerator(cpu=True)) is False and not is_sharded(target)


def _records(out) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "tau" in r]


HEADS = {"eagle3": {"kind": "eagle3", "draft_vocab_size": 128, "ttt_steps": 2},  # reads aux layers, embeddings
         "dflash": {"kind": "dflash", "block_size": 4, "num_layers": 2}}  # and the mask token's embedding


@pytest.fixture(scope="module")
def launched(tiny_files, tmp_path_factory):  # noqa: F811
    """One 2-process ``accelerate launch`` training the four runs in turn (each kind with a whole and a sharded
    target; support/train_in_turn.py): a launch's fixed cost once, not four times. Its root and output.
    eval_rows=5 over 2 processes: shards of 3 and 2 rows, 2 and 1 batches of 2 -> the second process must pad its
    target passes (pad_target_passes) or the first one waits forever in an all-gather. grad_accum_steps=2 and
    save_every=2: DFlash's whole-target run is also the DFlash DDP run (was test_dflash_train's own launch)."""
    root = tmp_path_factory.mktemp("sharding")
    configs = [tiny_dict(tiny_files, root / f"{kind}-{sharding}", head=head, data={"eval_rows": 5},
                         train={"max_steps": 4, "micro_batch_size": 2, "grad_accum_steps": 2, "lr": 3e-3,
                                "warmup_steps": 1, "eval_every": 2, "save_every": 2, "log_every": 1,
                                "target_sharding": sharding})
               for kind, head in HEADS.items() for sharding in ("none", "fsdp")]
    return root, launch_two_processes(configs, root)


@pytest.mark.slow
@pytest.mark.parametrize("kind", HEADS)
def test_sharded_target_trains_like_a_whole_one(launched, kind):
    root, run = launched
    assert run.stderr.count("decoder layers sharded over 2 processes") == 2  # the two fsdp runs, not the others
    finished = run.stdout.split(" head saved to ")[1:]  # each run's lines after its head is saved
    assert len(finished) == 4 and all("simulated tau " in lines for lines in finished)  # every run evaluated
    runs = {sharding: _records(root / f"{kind}-{sharding}") for sharding in ("none", "fsdp")}
    head = AutoHead.from_pretrained(root / f"{kind}-none")
    assert head.head_kind == kind and sorted((root / f"{kind}-none" / "checkpoints").iterdir())[-1].name == (
        "step-0000004")
    if kind == "eagle3":  # its draft vocabulary, built under DDP (was test_train_script's eagle3 run's check)
        built = json.loads(next((root / "cache" / "draft_vocab").glob("*.json")).read_text())["ids"]
        assert int(head.t2d.sum()) == 128
        assert head.t2d.nonzero().flatten().tolist() == built  # the vocabulary the data chose, not the default
    else:  # DFlash under DDP (was test_dflash_train's launch): its options reach the saved head
        assert head.config.num_layers == 2 and head.config.block_size == 4
    (whole_train, whole_eval), (sharded_train, sharded_eval) = runs["none"], runs["fsdp"]
    assert [r["step"] for r in sharded_train] == [1, 2, 3, 4] and len(sharded_eval) == len(whole_eval) == 2
    assert len({r["loss"] for r in whole_train}) > 1  # the head trains: the losses below are not all one number
    for whole, sharded in zip(whole_train + whole_eval, sharded_train + sharded_eval):
        for key in ("loss", "tau"):
            if key in whole:
                assert sharded[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), (key, whole, sharded)


def test_the_unsharded_parts_move_without_touching_the_layers():
    from support.targets import make_tiny_target

    from draftsmith.target.model import decoder_layers
    from draftsmith.train.target_sharding import _move_unsharded

    target = make_tiny_target("llama", tie_word_embeddings=True)
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight
    _move_unsharded(target, decoder_layers(target), torch.device("meta"))
    assert all(p.device.type == "cpu" for p in decoder_layers(target).parameters())
    rest = [p for n, p in target.named_parameters() if ".layers." not in n]
    assert rest and all(p.device.type == "meta" and not p.requires_grad for p in rest)
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight  # still tied


@pytest.mark.parametrize("name, processes, machines", [("fsdp-8gpu.yaml", 8, 1), ("fsdp-2node.yaml", 16, 2)])
def test_accelerate_configs_load_and_start_with_their_command(name, processes, machines):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    path = REPO / "configs" / "accelerate" / name
    loaded = load_config_from_file(str(path))
    assert (loaded.distributed_type, loaded.num_processes, loaded.num_machines) == (
        DistributedType.MULTI_GPU, processes, machines)
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# accelerate launch --config_file configs/accelerate/{name}") and "train_head.py" in first
    trained = first.split("--config ")[1].split()[0]
    cfg = load_config(REPO / trained)
    assert cfg.train.target_sharding == "fsdp"
