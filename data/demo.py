"""Where the demo LMs live, and reusing them instead of retraining.

A demo LM directory is complete when its ``demo_target.json`` carries the fingerprint of what
was asked for (recipe version, corpus, every ``LMSettings`` field and the tokenizer it borrowed) and
every file still has the size and sha256 recorded when it was built; a damaged one is said and rebuilt.
The default location is ``$DRAFTSMITH_CACHE/demo/<size>-seed<N>-<fingerprint>`` (the cache root
defaults to ``~/.cache/draftsmith``). Builds go to a temporary sibling that is renamed into place,
so an interrupted build never looks complete, under a file lock, so concurrent requests for the
same LM train it once (POSIX only: ``fcntl``).

``demo:tiny`` and ``demo:tiny-mtp`` (a dense Mellum trained with its MTP layer: ``data.demo_mtp``) also ship
built, in ``data/demo_targets/<size>-seed0/`` (``SHIPPED``; package data, so a ``pip install .`` has them too): a
request whose fingerprint equals the shipped copy's, with every shipped file as recorded, copies it into the cache
instead of training for 7 to 11 minutes. A changed recipe or corpus, or a damaged shipped file, is said in one line
and built as before. Refresh a copy after a recipe change with ``python scripts/make_demo_target.py --size SIZE
--ship``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from transformers import AutoTokenizer

from draftsmith.data.corpus import corpus_fingerprint
from draftsmith.data.base.names import DEMO_PREFIX
from draftsmith.data.base.paths import cache_lock, cache_root, changed_files, folder_digests, share_readable
from draftsmith.data.demo_lm import SUMMARY_FILE, LMSettings, settings_for, train_lm

# Bump when data/demo_lm.py or data/tokenizer.py change what the same settings produce.
RECIPE_VERSION = 2
# What a first build costs (README's table), said in the one line printed before it starts.
BUILD_TIME = {"tiny": "about 9 minutes on 2 idle CPU cores, longer on busy ones", "assistant": "about 4 minutes on 2 CPU cores",
              "small": "a GPU recipe: about an hour on one GPU, days on CPU",
              "tiny-hybrid": "about 10 minutes on 2 idle CPU cores, longer on busy ones",
              "tiny-mtp": "about 4 minutes on 2 idle CPU cores, longer on busy ones"}
# Sizes that borrow the tokenizer of another demo LM by default (same seed).
TOKENIZER_SOURCE = {"assistant": "tiny", "tiny-mtp": "tiny"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
FILES_KEY = "files"  # in the summary: {name: {"bytes", "sha256"}} of every file as built
# Built demo LMs that ship with draftsmith, one folder per "<size>-seed<seed>" (docs/setup.md: why).
SHIPPED = Path(__file__).resolve().parent / "demo_targets"


def tokenizer_key(tokenizer_dir: str | Path) -> str:
    """A hash of the tokenizer files in ``tokenizer_dir``."""
    tokenizer_dir = Path(tokenizer_dir)
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer_dir}")
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            h.update(name.encode() + b"\0" + (tokenizer_dir / name).read_bytes())
    return "files:" + h.hexdigest()[:16]


def fingerprint(settings: LMSettings, tokenizer: str | None) -> str:
    """The cache key of a demo LM (``tokenizer`` is None when it trains its own)."""
    payload = {"recipe": RECIPE_VERSION, "corpus": corpus_fingerprint(), "tokenizer": tokenizer,
               "settings": settings.cache_key()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def _resolve(size: str, seed: int, tokenizer_dir: str | Path | None, overrides: dict):
    """(settings, fingerprint, directory name) of a request."""
    settings = settings_for(size, seed=seed, **overrides)
    if tokenizer_dir is not None:
        key = tokenizer_key(tokenizer_dir)
    elif size in TOKENIZER_SOURCE:
        key = "demo:" + demo_target_dir(TOKENIZER_SOURCE[size], seed).name
    else:
        key = None
    fp = fingerprint(settings, key)
    return settings, fp, f"{size}-seed{seed}-{fp}"


def demo_target_dir(size: str = "tiny", seed: int = 0, *, tokenizer_dir: str | Path | None = None,
                    **overrides) -> Path:
    """The cache directory of a demo LM (which may not be built yet); overrides are LMSettings fields."""
    return cache_root() / "demo" / _resolve(size, seed, tokenizer_dir, overrides)[2]


def is_built(directory: Path, fp: str) -> bool:
    """Whether ``directory`` holds a complete demo LM with fingerprint ``fp``, every file as it was built."""
    return _summary(directory, fp) is not None and not damaged_files(directory)


def _summary(directory: Path, fp: str) -> dict | None:
    """The summary of the demo LM with fingerprint ``fp`` in ``directory`` (None: not that LM)."""
    try:
        summary = json.loads((directory / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("fingerprint") == fp else None


def record_files(directory: Path) -> None:
    """Write the size and sha256 of every file of a built demo LM into its summary (``FILES_KEY``)."""
    path = directory / SUMMARY_FILE
    summary = json.loads(path.read_text())
    summary[FILES_KEY] = folder_digests(directory, skip=(SUMMARY_FILE,))
    path.write_text(json.dumps(summary, indent=2) + "\n")


def damaged_files(directory: Path) -> list[str]:
    """The files of a built demo LM that are missing or differ from the record written when it was built. A
    summary without that record (edited, or written by a draftsmith before records) names itself: what its
    files hold now cannot be told from what was built, so it is never recorded as the truth, but rebuilt."""
    summary = json.loads((directory / SUMMARY_FILE).read_text())
    recorded = summary.get(FILES_KEY)
    if not isinstance(recorded, dict) or not recorded:
        return [SUMMARY_FILE]
    return changed_files(directory, recorded)


def ensure_demo_target(size: str = "tiny", seed: int = 0, *, out_dir: str | Path | None = None,
                       tokenizer_dir: str | Path | None = None, show_progress: bool = True,
                       **overrides) -> Path:
    """The directory of a trained demo LM, trained now only if no matching one exists.

    ``out_dir`` defaults to ``demo_target_dir(...)``. Sizes in ``TOKENIZER_SOURCE`` without a
    ``tokenizer_dir`` borrow the tokenizer of that demo LM (built first if missing). Must be called
    from a single process: it trains in-process.
    """
    settings, fp, name = _resolve(size, seed, tokenizer_dir, overrides)
    out = Path(out_dir) if out_dir is not None else cache_root() / "demo" / name
    default_request = tokenizer_dir is None and not overrides
    if is_built(out, fp):
        return out
    # The summary is read last: another process may rename its finished build into place meanwhile.
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and _summary(out, fp) is None:
        raise FileExistsError(f"{out} exists but is not a demo LM with fingerprint {fp} "
                              f"(size={size}, seed={seed}, overrides={overrides}); remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(out.parent / f".{out.name}.lock"):  # another process building it: wait, then reuse its result
        if _summary(out, fp) is not None:
            damaged = damaged_files(out)
            if not damaged:
                return out
            print(f"draftsmith: the cached demo target {out} is damaged ({', '.join(damaged)} missing or changed "
                  "since it was built): building it again", file=sys.stderr, flush=True)
            shutil.rmtree(out)  # our own cache entry, marked by its fingerprint
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        if _copy_shipped(SHIPPED / f"{size}-seed{seed}", fp, out, tmp, say_mismatch=default_request):
            return out
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise RuntimeError(f"demo LM {out} is missing and cannot be trained inside a distributed launch; "
                               f"build it first: python scripts/make_demo_target.py --size {size} --seed {seed}")
        if tokenizer_dir is None and size in TOKENIZER_SOURCE:
            tokenizer_dir = ensure_demo_target(TOKENIZER_SOURCE[size], seed, show_progress=show_progress)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir is not None else None
        arch = {"llama": "Llama", "qwen3_5": "Qwen3.5 hybrid", "mellum": "dense Mellum with an MTP layer"}[
            settings.architecture]
        print(f"draftsmith: building the demo target demo:{size} (a {settings.num_layers}-layer {arch} trained on "
              f"Python's standard library; {BUILD_TIME.get(size, 'minutes to hours')}, once: cached in {out})",
              file=sys.stderr, flush=True)
        try:
            train_lm(tmp, settings, tokenizer=tokenizer, show_progress=show_progress,
                     metadata={"fingerprint": fp, "size": size,
                               "tokenizer_source": str(tokenizer_dir) if tokenizer_dir is not None else None})
            record_files(tmp)  # what is_built checks on every later use
            share_readable(tmp)  # 0644/0755: a server running as another user reads the cache too
            os.replace(tmp, out)  # atomic; succeeds over an empty directory
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _copy_shipped(shipped: Path, fp: str, out: Path, tmp: Path, *, say_mismatch: bool) -> bool:
    """Copy the shipped demo LM ``shipped`` to ``out`` (through ``tmp``, renamed into place) if it is the one
    with fingerprint ``fp`` and every file is as recorded; False (said in one line when it is a default
    request or a damaged copy) if not. Caller holds ``out``'s lock."""
    if not (shipped / SUMMARY_FILE).is_file():
        return False
    summary = _summary(shipped, fp)
    if summary is None:
        if say_mismatch:
            try:
                shipped_fp = json.loads((shipped / SUMMARY_FILE).read_text()).get("fingerprint")
            except (OSError, ValueError, AttributeError):
                shipped_fp = "unreadable"
            print(f"draftsmith: the demo target shipped in {shipped} has fingerprint {shipped_fp}, this request "
                  f"{fp} (the recipe, its settings or the corpus, this Python's standard library, changed): "
                  "building it", file=sys.stderr, flush=True)
        return False
    recorded = summary.get(FILES_KEY)
    damaged = changed_files(shipped, recorded) if isinstance(recorded, dict) and recorded else [SUMMARY_FILE]
    if damaged:
        print(f"draftsmith: the demo target shipped in {shipped} is damaged ({', '.join(damaged)} missing or "
              "changed since it was built): building it", file=sys.stderr, flush=True)
        return False
    try:
        tmp.mkdir()
        for name in [*recorded, SUMMARY_FILE]:
            shutil.copyfile(shipped / name, tmp / name)
        share_readable(tmp)  # 0644/0755, as a build leaves it
        os.replace(tmp, out)  # atomic; succeeds over an empty directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"draftsmith: the demo target comes built with draftsmith ({shipped}, fingerprint {fp}): copied to {out}",
          file=sys.stderr, flush=True)
    return True


def demo_target_path(target: str) -> str:
    """A loadable path or hub id; ``demo:<size>`` is the demo LM of that size, built first if missing;
    ``demo:smollm2`` is SmolLM2-135M-Instruct, fetched and converted once (``data.assets``)."""
    if target == f"{DEMO_PREFIX}smollm2":
        from draftsmith.data.assets import smollm2_dir

        return str(smollm2_dir())
    if target.startswith(DEMO_PREFIX):
        return str(ensure_demo_target(target.removeprefix(DEMO_PREFIX)))
    return target
