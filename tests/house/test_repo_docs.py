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


def test_the_readmes_first_screen_holds_the_set_up_and_the_next_three_commands():
    """What draftsmith does, the two set-up commands (the test command between its markers, which
    .ci/run extracts), and generate with --compare, export and push, all within the first 60 lines."""
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:60])
    assert "lossless" in first and "draft heads" in first
    assert 'pip install torch==2.13.0 -e ".[dev]" && accelerate launch train/train_head.py' in first
    assert '<!-- test-command -->\n```bash\npip install torch==2.13.0 -e ".[dev]" && python -m pytest -q\n```\n' \
           "<!-- /test-command -->" in first
    for command in ("draftsmith generate --head runs/demo-tiny-eagle3 ", "python scripts/export.py --head "
                    "runs/demo-tiny-eagle3 ", "python scripts/push_to_hub.py --head runs/demo-tiny-eagle3 "):
        assert command in first, command
    assert "--compare" in first.split("draftsmith generate")[1].splitlines()[0]


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
