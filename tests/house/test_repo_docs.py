"""Files cite only documents the repository contains."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from support.house import REPO as ROOT


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / line for line in out.splitlines()
            if line.endswith((".py", ".md", ".yaml", ".toml", ".txt")) and (ROOT / line).is_file()]


def test_every_cited_document_exists():
    cited = re.compile(r"\b((?:docs/)?[A-Za-z][\w-]*\.md)\b")
    missing = []
    for path in _tracked():
        if path.name == Path(__file__).name:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in cited.findall(line):
                if name.startswith("docs/") or name.isupper() or name.split(".")[0].isupper():
                    candidates = [ROOT / name, path.parent / name]
                    if not any(c.is_file() for c in candidates) and name != "README.md":
                        missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, missing


def test_no_file_cites_the_missing_reference_notes():
    assert not [str(p.relative_to(ROOT)) for p in _tracked()
                if p.name != Path(__file__).name and "REFERENCE" in p.read_text(errors="replace")]


def test_readme_says_what_the_torch_pin_does_and_gives_one_thread_advice():
    readme, setup = (ROOT / "README.md").read_text(), (ROOT / "docs" / "setup.md").read_text()
    assert "[docs/setup.md](docs/setup.md)" in readme  # the notes live there, linked from the first screen
    assert "does not pull CUDA wheels" not in readme + setup  # the pin selects a version, not a build
    assert "download.pytorch.org/whl/cpu" in setup
    assert "--num_cpu_threads_per_process 2` to use\nboth cores" not in setup and "--threads N" in setup


def first_screen(readme: str) -> str:
    """README up to its "Supported targets" heading: what a newcomer reads before the reference."""
    return readme.split("## Supported targets")[0]


def first_screen_problems(readme: str) -> list[str]:
    """What keeps README's entrance from being one: over 40 lines, a first paragraph over two sentences, a missing
    command (the two set-up commands between the markers .ci/run extracts, generate --compare, export, push), no
    results table with tau at T = 0 and T = 1 and the --compare speedup, a history of tau, a second invocation style."""
    first = first_screen(readme)
    problems = [f"{len(first.splitlines())} lines (at most 40)"] if len(first.splitlines()) > 40 else []
    intro = first.split("\n\n")[1]
    if len([s for s in intro.replace("\n", " ").split(". ") if s.strip()]) > 2:
        problems.append("the first paragraph has more than two sentences")
    for command in ('pip install torch==2.13.0 -e ".[dev]" && accelerate launch train/train_head.py',
                    '<!-- test-command -->\n```bash\npip install torch==2.13.0 -e ".[dev]" && python -m pytest -q\n```\n'
                    "<!-- /test-command -->", "draftsmith generate --head runs/demo-tiny-eagle3 ",
                    "draftsmith export --head runs/demo-tiny-eagle3 ", "draftsmith push --head runs/demo-tiny-eagle3 "):
        if command not in first:
            problems.append(f"missing: {command.splitlines()[0]}")
    table = [line for line in first.splitlines() if line.startswith("|")]
    if not table or not all(word in "\n".join(table) for word in ("T = 0", "T = 1", "--compare")):
        problems.append("no results table with tau at T = 0 and T = 1 and the --compare speedup")
    if any(word in first for word in ("raised it", "before `", "which raised")):
        problems.append("a history of tau (it belongs in docs/)")
    if "python scripts/" in readme:
        problems.append("a second invocation style: python scripts/X.py (draftsmith COMMAND is the one)")
    return problems


def test_the_readmes_first_screen_is_an_entrance():
    """Two sentences, the two set-up commands, the next three, one table of today's results with links; the
    history of the numbers lives in docs/setup.md; one invocation style throughout."""
    assert first_screen_problems((ROOT / "README.md").read_text()) == []


def test_the_entrance_check_can_fail():
    readme = (ROOT / "README.md").read_text()
    first = first_screen(readme)
    assert first_screen_problems(readme.replace(first, first + "x\n" * 40))[0].endswith("lines (at most 40)")
    assert first_screen_problems(readme.replace("draftsmith export --head", "python scripts/export.py --head")) == [
        "missing: draftsmith export --head runs/demo-tiny-eagle3 ",
        "a second invocation style: python scripts/X.py (draftsmith COMMAND is the one)"]
    assert "a history of tau (it belongs in docs/)" in first_screen_problems(
        readme.replace("## Set up", "It was 4.5, before `x` raised it.\n\n## Set up"))
    intro = first.split("\n\n")[1]
    assert first_screen_problems(readme.replace(intro, intro + " A third. A fourth.")) == [
        "the first paragraph has more than two sentences"]


def readme_python_snippet(heading: str) -> str:
    """The first ```python block under README's ``heading`` (a line '## heading')."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_generate_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    """README's Python 'Generate' snippet, executed from README's text: names the main job's target
    (demo:tiny, here a tiny stand-in with a tokenizer: building the real one takes minutes) and head
    (runs/demo-tiny-eagle3, here a fresh head in a scratch working directory)."""
    import torch
    from support.targets import make_tiny_target
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import draftsmith.data.demo

    from draftsmith import data
    from draftsmith.heads import build_head

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 96)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    target = make_tiny_target("llama", initializer_range=0.3)
    target.save_pretrained(tmp_path / "demo-tiny")
    tokenizer.save_pretrained(tmp_path / "demo-tiny")
    monkeypatch.setattr(data.demo, "demo_target_path", lambda name: str(tmp_path / "demo-tiny"))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    build_head("eagle3", target).save_pretrained(tmp_path / "runs" / "demo-tiny-eagle3")
    snippet = readme_python_snippet("Generate")
    assert '"demo:tiny", "runs/demo-tiny-eagle3"' in snippet  # the main job's own names, not placeholders
    scope: dict = {}
    exec(compile(snippet, "README.md (Generate)", "exec"), scope)  # noqa: S102 - the README's own text
    ids, out = scope["input_ids"], scope["out"]
    assert ids.shape[0] == 1 and out.shape[1] > ids.shape[1]
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 2 and float(printed[-1].split()[0]) >= 1.0  # tau, then tokens/s
