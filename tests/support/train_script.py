"""Helpers moved out of tests/train/test_train_script.py (other test files share them; no tests here)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml
from support.targets import free_port
from support.train_fixtures import MAX_LENGTH


SCRIPT = Path(__file__).resolve().parent.parent.parent / "train" / "train_head.py"
IN_TURN = Path(__file__).resolve().parent / "train_in_turn.py"


def launch_two_processes(config: dict | list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    """``accelerate launch`` of train_head.py on 2 CPU processes. accelerate 1.x starts several CPU
    processes through its multi-process launcher when ACCELERATE_USE_CPU is set; ``--cpu`` alone
    starts one process. A list of configs trains each in turn in the one launch (``train_in_turn.py``)."""
    configs = config if isinstance(config, list) else [config]
    paths = []
    for one in configs:
        paths.append(tmp_path / f"ddp-{Path(one['output_dir']).name}.yaml")
        paths[-1].write_text(yaml.safe_dump(one))
    script = [str(SCRIPT), "--config"] if isinstance(config, dict) else [str(IN_TURN)]
    # CUDA_VISIBLE_DEVICES="": on a GPU machine the two ranks would otherwise pick cuda:0 and cuda:1.
    ports: list[str] = []  # the launch's, then one a further run (train_in_turn.py); distinct
    while len(ports) < len(configs):
        ports = list(dict.fromkeys([*ports, str(free_port())]))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "IN_TURN_PORTS": ",".join(ports[1:])}
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", ports[0],
           *script, *map(str, paths)]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300 * len(configs))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def tiny_dict(files: dict, out: Path, **sections) -> dict:
    config = {"target": str(files["target"]), "output_dir": str(out), "cache_dir": str(out.parent / "cache"),
              "data": {"train": str(files["train"]), "eval": str(files["eval"]), "max_length": MAX_LENGTH,
                       "eval_rows": 8},
              "train": {"eval_decode_rows": 2, "eval_decode_tokens": 8}}  # decode tau runs, on a tiny share
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config
