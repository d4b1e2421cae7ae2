"""The ``draftsmith`` console entry point dispatches to every existing command."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest

from draftsmith.scripts.commands import COMMANDS, RENAMED, main
from support.house import REPO as ROOT


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_resolves_to_an_entry_point(name):
    module, function, _ = COMMANDS[name]
    assert callable(getattr(importlib.import_module(module), function))


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main([]) == 2  # no command: usage, and a usage error


def test_unknown_command_is_one_line(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown command 'trian'" in err


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_a_renamed_command_names_the_new_one_in_one_line(old, new, capsys):
    assert main([old, "--help"]) == 2 and new in COMMANDS and old not in COMMANDS
    assert capsys.readouterr().err.strip() == f"error: 'draftsmith {old}' is now 'draftsmith {new}'"


def test_each_commands_file_is_named_as_the_command():
    """``draftsmith X-Y`` runs ``scripts/x_y.py`` (``draftsmith calibrate`` ran draft_calibration.py, and
    ``speculation-plan`` calibrate_speculation.py); the entries that are no scripts/ file name their own."""
    own = {"train": "train_head", "generate": "generate_command", "bench": "benchmark", "push": "push_to_hub",
           "make-demo": "make_demo_target"}
    for name, (module, _, _) in COMMANDS.items():
        assert module.rsplit(".", 1)[1] == own.get(name, name.replace("-", "_")), (name, module)


def test_a_command_runs_with_its_own_errors(tmp_path, capsys):
    # export of a head directory that does not exist: the export script's one-line error, exit 2
    assert main(["export", "--head", str(tmp_path / "missing"), "--to", "vllm", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "missing" in err[0]


def test_module_and_console_script(tmp_path):
    runs = [[sys.executable, "-m", "draftsmith.scripts.commands", "--help"]]
    if shutil.which("draftsmith"):  # installed by `pip install -e .` ([project.scripts])
        runs.append(["draftsmith", "--help"])
    for cmd in runs:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "bench-scale" in done.stdout, cmd


# Run in a fresh interpreter: whether torch and transformers were imported when the process ends.
PROBE = ("import sys, atexit; atexit.register(lambda: print('loaded:', 'torch' in sys.modules, 'transformers' in "
         "sys.modules, file=sys.stderr)); {}")


@pytest.mark.parametrize("call, name", [
    ("from draftsmith.scripts.commands import main; sys.exit(main(['generate', {}]))", "draftsmith generate"),
    ("from draftsmith.infer.generate_command import cli; sys.exit(cli([{}]))", "python -m draftsmith.infer.generate_command"),
])
@pytest.mark.parametrize("mistake, message", [
    ("'--head', 'h', '--prompt', 'x', '--max-new-tokens', '0'", "argument --max-new-tokens: a whole number >= 1"),
    ("'--drafter', 'ngram', '--prompt', 'x'", "--drafter needs --target"),
])
def test_generate_reports_argument_mistakes_before_torch_loads_naming_the_command(call, name, mistake, message):
    """An argument mistake is one line in under a second (torch and transformers took 15-26 s to load
    first), naming the command the user typed: ``draftsmith generate`` through the draftsmith command."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(call.format(mistake))], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert f"{name}: error: {message}" in done.stderr
    assert "loaded: False False" in done.stderr


def test_regenerate_reports_argument_mistakes_before_torch_loads():
    """--engine openai never needs torch: a mistake in its arguments is one line in under a second."""
    call = ("from draftsmith.data.entry_point import run; from draftsmith.scripts.regenerate import main; sys.exit(run(main, ['--target', 't', "
            "'--data', 'd', '--out', 'o.jsonl', '--engine', 'openai', '--timeout', '0']))")
    done = subprocess.run([sys.executable, "-c", PROBE.format(call)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 2 and "argument --timeout: a number > 0 expected" in done.stderr, done.stderr
    assert "loaded: False False" in done.stderr


# One argument mistake per command, each caught by argparse or the config's first checks: exit code 2 and
# one line before torch or transformers load (they took 15-26 s on a busy 2-core machine).
MISTAKES = {
    "train": ["--no-such-option"],
    "launch": ["train.max_steps=0"],  # the training's arguments; accelerate's own options load torch first
    "generate": ["--head", "h", "--prompt", "x", "--max-new-tokens", "0"],
    "export": ["--head", "h", "--to", "nope", "--out", "o"],
    "check-export": ["e", "--head", "h", "--target", "t", "--steps", "0"],
    "check-target": ["t", "--steps", "1"],
    "bench": ["--target", "t", "--trees", "bogus"],
    "bench-scale": ["--shape", "nope"],
    "regenerate": ["--target", "t", "--data", "d", "--out", "o.jsonl", "--engine", "openai", "--timeout", "0"],
    "push": ["--head", "h", "--repo-id", "u/n", "--format", "nope"],
    "make-demo": ["--size", "huge"],
    "draft-calibration": ["--target", "t", "--heads", "h", "--num-prompts", "0"],
    "cost": ["--gpus", "1", "train.max_stepz=1"],
    "drift": ["--head", "h", "--target", "t", "--threshold", "2"],
    "speculation-plan": ["--target", "t", "--head", "h", "--lengths", "x"],
    "dump-features": ["--out", "o", "--dtype", "fp4"],
    "calibrate-layer-skip": ["--target", "t", "--depth", "0"],
    "rank-heads": ["r", "--no-such-option"],
    "plot-runs": ["--runs", "r"],
    "stitch": ["e", "t"],  # OUT_DIR missing
}
# The file each command runs on its own (python FILE ARGS), where it has one.
FILES = {"train": "train/train_head.py", "launch": "scripts/launch.py", "generate": "infer/generate_command.py",
         "export": "scripts/export.py", "check-export": "scripts/check_export.py",
         "check-target": "scripts/check_target.py", "bench": "scripts/benchmark.py",
         "bench-scale": "scripts/bench_scale.py",
         "regenerate": "scripts/regenerate.py", "push": "scripts/push_to_hub.py",
         "make-demo": "scripts/make_demo_target.py", "draft-calibration": "scripts/draft_calibration.py",
         "cost": "scripts/cost.py", "drift": "scripts/drift.py", "speculation-plan": "scripts/speculation_plan.py",
         "dump-features": "scripts/dump_features.py",
         "calibrate-layer-skip": "scripts/calibrate_layer_skip.py", "rank-heads": "scripts/rank_heads.py",
         "plot-runs": "scripts/plot_runs.py", "stitch": "scripts/stitch.py"}


def test_every_command_has_a_mistake_and_a_file():
    assert set(MISTAKES) == set(COMMANDS) == set(FILES)


@pytest.mark.parametrize("how", ["draftsmith", "file"])
@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_every_entry_point_reports_argument_mistakes_before_torch_loads(name, how, tmp_path):
    if how == "draftsmith":
        call = f"from draftsmith.scripts.commands import main; sys.exit(main({[name, *MISTAKES[name]]!r}))"
    else:  # as `python FILE ARGS` runs it: the file as __main__, its folder first on sys.path
        path = ROOT / FILES[name]
        call = (f"import runpy; sys.argv = {[str(path), *MISTAKES[name]]!r}; sys.path.insert(0, {str(path.parent)!r}); "
                f"runpy.run_path({str(path)!r}, run_name='__main__')")
    env = {**os.environ, "DRAFTSMITH_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PROBE.format(call)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert lines[-1] == "loaded: False False", done.stderr
    assert "error" in lines[-2] and "Traceback" not in done.stderr, done.stderr  # argparse's usage, one line


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_commands_help_answers_before_torch_loads(name, tmp_path):
    """`draftsmith train --help` took 28.6 s from the installed wheel (its head kinds and the config's checks
    loaded torch and transformers); the others 0.1-0.4 s. Every --help now answers without them."""
    call = f"from draftsmith.scripts.commands import main; sys.exit(main({[name, '--help']!r}))"
    done = subprocess.run([sys.executable, "-c", PROBE.format(call)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "DRAFTSMITH_CACHE": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    assert done.stderr.strip().splitlines()[-1] == "loaded: False False", done.stderr
    if name == "train":  # the values of configs/demo.yaml, the kinds by name
        assert "output_dir = runs/demo-tiny-eagle3" in done.stdout and "train.max_steps = 300" in done.stdout
        assert "medusa | eagle | eagle3 | dflash | early-exit | mtp" in done.stdout


def test_the_light_name_lists_are_the_real_ones():
    """The names argparse checks before torch loads are the keys of the tables that load it."""
    from draftsmith.data.base.names import DEMO_SIZES, EXPORT_FORMATS, FEATURE_DTYPES, HEAD_KINDS
    from draftsmith.data.demo_lm import SIZES
    from draftsmith.data.feature_store import DTYPES
    from draftsmith.heads.kinds import HEAD_CLASSES
    from draftsmith.heads.formats import FORMATS

    assert HEAD_KINDS == tuple(HEAD_CLASSES)
    assert EXPORT_FORMATS == tuple(FORMATS)
    assert FEATURE_DTYPES == tuple(DTYPES)
    assert DEMO_SIZES == tuple(SIZES)
