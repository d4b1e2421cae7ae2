"""Parity of an export with its consumer's own code: the speculators library, run in its own venv (its pins,
transformers <= 5.19, conflict with ours), loads the export and drafts on target states we give it; the
caller compares those drafts with the head's own (``scripts/check_export.py``, docs/export-keys.md).

The venv lives under ``~/.cache/draftsmith/venvs/`` and is created only on request (``create=True``,
``check-export --install``, CI's ``.ci/run``) from the running interpreter: torch comes from its site-packages
(a venv's too) at the installed version, speculators and its pinned transformers without their dependencies,
plus what its import and load need (openai, hs-connectors, loguru).
"""
from __future__ import annotations

import atexit
import json
import os
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import IO

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

SPECULATORS_VERSION = "0.9.0"
# What `import speculators` needs beyond our own environment (pip download speculators==0.9.0 --no-deps: its
# METADATA pins transformers<=5.19.0, torch<=2.14.1; its import and load pull openai, hs-connectors and loguru).
VENV_PACKAGES = (f"speculators=={SPECULATORS_VERSION}", "transformers==5.19.0")
VENV_IMPORT_DEPENDENCIES = ("openai", f"hs-connectors=={SPECULATORS_VERSION}", "loguru==0.7.3")
RUNNER = Path(__file__).with_name("consumer_speculators.py")


# What each format was checked against, and how: the section every export's README.md ends with.
_SOURCE = ("by reading its loader's source: every key it reads is written as docs/export-keys.md lists "
           "(tests/heads/test_export_keys.py); not run here, no engine runs on CPU")
CHECKED_AGAINST = {
    "vllm": [f"vLLM `llama_eagle3.py` (2026, with `fc_norm`/`norm_output`) and SGLang `llama_eagle3.py`, {_SOURCE}",
             "SpecForge reads `norm_output` otherwise (docs/export-keys.md): a plain head writes none, which every "
             "reader takes as plain EAGLE-3; an EAGLE-3.1 head (`norm_output: true`) is not for SpecForge"],
    "speculators": [f"speculators {SPECULATORS_VERSION}: loaded with its own `from_pretrained` and run on the same "
                    "target states as the head by `draftsmith check-export DIR --head HEAD --target TARGET` "
                    "(every tensor exact, max logit difference <= 1e-4, every drafted token equal)",
                    f"vLLM's speculators reader (`update_eagle3` / `update_dflash`) and drafters, {_SOURCE}"],
    **{fmt: [f"{engine}'s loader: the tensor names and shapes it reads (heads/formats/{module}.py) checked on "
             "export and on read-back; not run here, no engine runs on CPU"]
       for fmt, engine, module in (("eagle-vllm", "vLLM's EAGLE-1", "eagle"),
                                   ("medusa-vllm", "vLLM's Medusa", "medusa"), ("medusa-tgi", "TGI's Medusa", "medusa"))},
    "dflash": ["z-lab's `DFlashDraftModel` (DFlash2: `DFlash2DraftModel`) layout (docs/dflash.md), checked on export and on read-back",
               f"vLLM `qwen3_dflash.py` (non-causal through `layer_types`), {_SOURCE}"],
}
CHECKED_AGAINST["sglang"] = CHECKED_AGAINST["vllm"]
CHECKED_AGAINST["mtp"] = [
    "the names vLLM's `deepseek_mtp.py` / `qwen3_next_mtp.py` loaders read and the published checkpoints' index files "
    "hold (docs/export-keys.md, tests/heads/test_export_keys.py), checked on export and on read-back",
    "`draftsmith stitch` into a copy of the target's folder: transformers loads the copy as the same target, and "
    "`head.init=native` reads these tensors back bit for bit (tests/scripts/test_stitch.py); no engine run here"]


def checked_section(fmt: str) -> str:
    """The README section naming the consumer versions ``fmt`` was checked against, and how."""
    return "\n## Checked against\n\n" + "".join(f"- {line}\n" for line in CHECKED_AGAINST[fmt])


def venv_dir() -> Path:
    """Where the speculators venv lives (``DRAFTSMITH_VENVS`` overrides ``~/.cache/draftsmith/venvs``)."""
    root = os.environ.get("DRAFTSMITH_VENVS") or Path.home() / ".cache" / "draftsmith" / "venvs"
    return Path(root) / f"speculators-{SPECULATORS_VERSION}"


def speculators_python(create: bool = False) -> Path:
    """The venv's python with speculators importable; built only when ``create`` (minutes, downloads)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    if create and _import_problem(python):
        build_venv(venv)
    problem = _import_problem(python)
    if problem and create:
        raise FileNotFoundError(f"the speculators {SPECULATORS_VERSION} venv at {venv} was built but does not import "
                                f"it: {problem}; remove {venv} and pass --install again")
    if problem:
        raise FileNotFoundError(f"no speculators {SPECULATORS_VERSION} venv at {venv}: pass --install to create "
                                "it (pip, from the package index), or --python an interpreter that imports it")
    return python


def build_venv(venv: Path) -> None:
    """Create the venv from the running interpreter: the system site-packages and this interpreter's own (a venv's,
    where draftsmith and torch were installed, through a ``.pth``) after its own, and torch constrained to the
    installed version, so pip never pulls another torch (PyPI's Linux default is a multi-GB CUDA build)."""
    print(f"creating the speculators {SPECULATORS_VERSION} venv at {venv} (pip, from the package index)",
          file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]]) if Path(p).is_dir()]
    (Path(purelib) / "draftsmith-parent.pth").write_text("".join(f"{p}\n" for p in ours))
    with tempfile.TemporaryDirectory(prefix="draftsmith-venv-") as tmp:
        constraint = Path(tmp) / "constraints.txt"
        constraint.write_text(f"torch=={torch.__version__}\n")
        env = {**os.environ, "PIP_CONSTRAINT": str(constraint)}  # ours: this torch, nothing else pinned
        # --no-warn-conflicts: speculators is installed without its dependencies on purpose (its pins are not
        # ours); pip's "ERROR: ... dependency conflicts" after a good install read as a failed one
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-warn-conflicts"]
        subprocess.run([*pip, "--no-deps", *VENV_PACKAGES], check=True, env=env)
        subprocess.run([*pip, *VENV_IMPORT_DEPENDENCIES], check=True, env=env)


def _import_problem(python: Path) -> str | None:
    """Why ``python`` does not import speculators at our version (its error's last line), or None."""
    if not python.is_file():
        return f"{python} does not exist"
    probe = ("import importlib.metadata as m; from speculators import SpeculatorModel; "
             f"v = m.version('speculators'); assert v == {SPECULATORS_VERSION!r}, 'speculators ' + v")
    done = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["exit code 1"])[-1]


def run_speculators(python: Path, export: Path, verifier: str, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the library computes for ``export`` on ``inputs`` (see ``consumer_speculators.py``), from one
    library process per interpreter kept for the life of this one (its import costs about 10 s)."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-parity-") as tmp:
        inputs_path, out_path = Path(tmp) / "inputs.safetensors", Path(tmp) / "out.safetensors"
        save_file({k: v.contiguous() for k, v in inputs.items()}, str(inputs_path))
        answer = _ask(python, [str(export), str(inputs_path), str(out_path), verifier])
        if answer != "ok":
            raise RuntimeError(f"speculators {SPECULATORS_VERSION} could not load {export}: "
                               f"{answer.removeprefix('error: ') or _last_words(python)}")
        return load_file(str(out_path))


_CONSUMERS: dict[str, tuple[subprocess.Popen, IO[str]]] = {}  # interpreter -> its library process, that one's stderr


def _ask(python: Path, request: list[str]) -> str:
    """Send one request to ``python``'s library process (started on first use) and read its one-line answer."""
    consumer, _ = _CONSUMERS.get(str(python), (None, None))
    if consumer is None or consumer.poll() is not None:
        log = tempfile.TemporaryFile("w+")
        consumer = subprocess.Popen([str(python), "-I", str(RUNNER), "--serve"],  # -I: not heads/formats on sys.path
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        _CONSUMERS[str(python)] = consumer, log
        atexit.register(_close, consumer)
    try:
        consumer.stdin.write(json.dumps(request) + "\n")
        consumer.stdin.flush()
    except BrokenPipeError:
        return ""
    return consumer.stdout.readline().strip()


def _last_words(python: Path) -> str:
    """The last lines the library process wrote to stderr before it ended."""
    log = _CONSUMERS[str(python)][1]
    log.seek(0)
    return " | ".join(log.read().strip().splitlines()[-3:]) or "its process ended"


def _close(consumer: subprocess.Popen) -> None:
    if consumer.poll() is None:
        consumer.stdin.close()  # its loop ends
        try:
            consumer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            consumer.kill()


def compare_steps(ours: list[Tensor], theirs: list[Tensor], atol: float, label: str = "step",
                  first: int = 0) -> tuple[list[str], bool]:
    """One line per draft step: max |logit difference| and whether the drafted tokens (argmax) agree.
    ``ours[k]``/``theirs[k]`` are (N, Vd) logits of step ``first + k`` at the same N positions."""
    if len(ours) != len(theirs):
        return [f"steps: ours {len(ours)}, theirs {len(theirs)}"], False
    lines, ok = [], True
    for k, (a, b) in enumerate(zip(ours, theirs)):
        diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else float("inf")
        same = a.shape == b.shape and bool(torch.isfinite(b).all()) and torch.equal(a.argmax(-1), b.argmax(-1))
        agree = int((a.argmax(-1) == b.argmax(-1)).sum()) if a.shape == b.shape else 0
        good = same and diff <= atol
        ok &= good
        lines.append(f"{label} {first + k}: max |logit diff| {diff:.3g}, drafted tokens {agree}/{a.shape[0]} equal "
                     f"{'ok' if good else 'MISMATCH'}")
    return lines, ok


def compare_tensors(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> tuple[list[str], bool]:
    """Every tensor of ``ours`` equal in ``theirs`` (the consumer's loaded state), one line per difference and
    a count; ``theirs`` may hold more (what the consumer fills from the verifier)."""
    lines = []
    for name, tensor in ours.items():
        other = theirs.get(name)
        if other is None:
            lines.append(f"{name}: not in the loaded model MISMATCH")
        elif other.shape != tensor.shape or not torch.equal(other.float(), tensor.float()):
            lines.append(f"{name}: loaded values differ (max {(other.float() - tensor.float()).abs().max():.3g}) "
                         "MISMATCH" if other.shape == tensor.shape else f"{name}: shape {tuple(other.shape)} MISMATCH")
    lines.append(f"tensors: {len(ours) - len(lines)}/{len(ours)} loaded exactly")
    return lines, len(lines) == 1

