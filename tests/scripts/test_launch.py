"""``draftsmith launch`` (scripts/launch.py): accelerate's launcher in-process, ending with the training
processes' own exit code — 2 and one line for a mistake, with one process or two, where plain
``accelerate launch`` can only end in 1 (or the 143 of the SIGTERM the training sends it)."""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from support.targets import free_port

from draftsmith.scripts.launch import exit_code, split_args
from support.house import REPO as ROOT


def test_split_args():
    assert split_args(["--num_processes", "2", "--multi_gpu", "--config", "c.yaml", "train.lr=1"]) == (
        ["--num_processes", "2", "--multi_gpu"], ["--config", "c.yaml", "train.lr=1"])
    assert split_args(["--mixed_precision=no", "train.lr=1"]) == (["--mixed_precision=no"], ["train.lr=1"])
    assert split_args(["--cpu"]) == (["--cpu"], [])
    assert split_args(["--config=c.yaml"]) == ([], ["--config=c.yaml"])


def test_exit_code_of_the_launchers_failures():
    assert exit_code(subprocess.CalledProcessError(2, ["python"])) == 2
    assert exit_code(subprocess.CalledProcessError(-15, ["python"])) == 1  # killed by a signal: a failure
    elastic = SimpleNamespace(failures={0: SimpleNamespace(exitcode=2), 1: SimpleNamespace(exitcode=-15)})
    assert exit_code(elastic) == 2  # rank 0 reported the mistake, rank 1 was stopped by the launcher
    assert exit_code(RuntimeError("no process started")) == 1


@pytest.mark.parametrize("processes", [1, 2])
def test_a_mistake_exits_2_with_one_line(tmp_path, processes):
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    options = ["--num_processes", str(processes), "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port())]
    if processes > 1:
        options.insert(0, "--multi_gpu")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), *options, "train.micro_batch_size=0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "config error: train.micro_batch_size must be >= 1, got 0" in run.stderr
    assert "Traceback" not in run.stderr and "CalledProcessError" not in run.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch.py"), "--num_processez", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--num_processez is not an option of accelerate launch" in bad.stderr


PROBE = "from draftsmith.train.launcher import threads_are_launcher_default as d; print('launcher default:', d())"


@pytest.mark.parametrize("options, omp, expected", [
    ([], None, True),  # accelerate's own default of 1 thread: training measures instead
    ([], "1", False),  # the user's OMP_NUM_THREADS is kept
    (["--num_cpu_threads_per_process", "1"], None, False),  # and so is the user's launcher option
])
def test_training_tells_accelerates_thread_default_from_the_users_choice(tmp_path, options, omp, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": ""})
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    run = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                          "--mixed_precision", "no", "--dynamo_backend", "no", *options, str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"launcher default: {expected}" in run.stdout
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60)
    assert "launcher default: False" in plain.stdout  # not launched: nothing to replace


@pytest.mark.parametrize("option", ["--num_processes", "--num_machines", "--num_cpu_threads_per_process"])
def test_a_count_of_0_is_refused_before_anything_starts(option, capsys):
    """accelerate reads ``--num_processes 0`` as "not given" and trains with one process, exit 0."""
    from draftsmith.scripts.launch import cli

    assert cli([option, "0", "train.max_steps=1"]) == 2
    assert capsys.readouterr().err == f"error: {option} must be >= 1, got 0\n"


def test_an_unknown_accelerate_option_is_one_line_before_torch_loads(tmp_path):
    """``--no-such-flag`` printed accelerate's 113-line usage after its parser had loaded torch and the training
    config's head classes (52 s on a busy machine): now one line, exit 2, with torch never imported. The
    known options (read from the installed accelerate's source), their abbreviations and numbers pass."""
    from draftsmith.scripts.launch import unknown_options

    assert unknown_options(["--num_processes", "2", "--multi_gpu", "--num_proc=2", "--mixed_precision=bf16",
                            "--main_process_port", "-1"]) == []
    assert unknown_options(["--cpu", "--no-such-flag", "x"]) == ["--no-such-flag"]
    probe = ("import sys\nfrom draftsmith.scripts.launch import cli\ncode = cli(['--no-such-flag'])\n"
             "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert done.stderr.count("\n") == 1 and "--no-such-flag is not an option of accelerate launch" in done.stderr
