"""Rows → cached, tokenized training examples (``input_ids``, ``loss_mask``) plus a Summary.

``build_examples`` keeps the row order, rejects bad rows with a counted reason (or raises in
strict mode), applies an explicit over-length policy, and caches the result with ``datasets``
under ``<cache_dir>/<key>``, key = hash(data fingerprint, tokenizer fingerprint (vocab, merges,
added tokens, special tokens, chat template), settings, code version). The default cache dir is
``$DRAFTSMITH_CACHE/data``, else ``~/.cache/draftsmith/data``.

Columns: ``input_ids`` int32 and ``loss_mask`` int8 lists (see ``data.masks`` for the mask).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from draftsmith.data.base.names import DEMO_PREFIX
from draftsmith.data.base.paths import cache_root, changed_files, folder_digests
from draftsmith.data.jsonfile import read_json
from draftsmith.data.conversations import NO_LOSS_AFTER_TRUNCATION, OVERLONG, REASONS, RowError, normalize_row
from draftsmith.data.masks import Method, encode_conversation, encode_text, mask_method

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("draftsmith.data")
Overlong = Literal["truncate", "drop"]
_CODE_FILES = ("conversations.py", "masks.py", "pipeline.py")


@dataclass
class Summary:
    """What happened to every input row. ``rows_in == examples_out + sum(skipped.values())``."""

    rows_in: int = 0
    examples_out: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    truncated: int = 0  # kept examples cut to max_length
    tokens: int = 0  # over kept examples
    loss_tokens: int = 0  # tokens with loss_mask 1
    mask_method: str | None = None  # "generation" / "prefix_diff"; None when no conversation row
    normalized: dict[str, int] = field(default_factory=dict)  # ShareGPT repair -> count (data.conversations)
    bytes_ignored: int = 0  # trailing bytes of a truncated JSON array left unread (lenient_json)
    first_error: str | None = None  # "row N: reason: detail" of the first skipped row
    cache_hit: bool = False
    cache_path: str = ""

    def __str__(self) -> str:
        lines = [
            f"rows in {self.rows_in}, examples out {self.examples_out} "
            f"({100 * self.examples_out / max(self.rows_in, 1):.1f}%), "
            f"skipped {sum(self.skipped.values())}, truncated {self.truncated}",
            f"tokens {self.tokens}, loss tokens {self.loss_tokens}, mask method {self.mask_method}",
        ]
        lines += [f"  skipped {reason}: {n}" for reason, n in self.skipped.items()]
        lines += [f"  normalized {what}: {n}" for what, n in self.normalized.items()]
        if self.bytes_ignored:
            lines.append(f"  truncated JSON: ignored the last {self.bytes_ignored} bytes after the last complete row")
        if self.first_error:
            lines.append(f"  first skipped: {self.first_error}")
        lines.append(f"cache {'hit' if self.cache_hit else 'miss'}: {self.cache_path}")
        return "\n".join(lines)


def default_cache_dir() -> Path:
    """Where tokenized examples are cached: ``cache_root() / "data"``."""
    return cache_root() / "data"


def load_rows(source: object, *, lenient_json: bool = False) -> list[dict] | datasets.Dataset:
    """Rows from a .json/.jsonl/.parquet path, a ``datasets.Dataset``, a list of dicts,
    ``"stdlib:train"`` / ``"stdlib:heldout"`` (text chunks of the Python standard library) or
    ``"demo:sharegpt"`` / ``"demo:sharegpt:heldout"`` (ShareGPT, fetched once; ``data.assets``).

    A .json file holds a list of rows, or a dict with exactly one list-of-rows value.
    ``lenient_json=True`` reads a truncated JSON array (or a JSONL file whose last line is cut)
    up to its last complete row instead of raising.
    """
    return _load_rows(source, lenient_json)[0]


def _load_rows(source: object, lenient_json: bool) -> tuple[list[dict] | datasets.Dataset, int]:
    """(rows, bytes ignored at the end of a truncated file)."""
    if isinstance(source, list):
        return source, 0
    if isinstance(source, str) and source.startswith("stdlib:"):
        from draftsmith.data.corpus import corpus_rows  # lazy: scans the stdlib, only needed for this source

        return corpus_rows(source.removeprefix("stdlib:")), 0  # validates the split name
    if isinstance(source, str) and source.startswith(DEMO_PREFIX):
        from draftsmith.data.assets import demo_rows  # lazy: fetches the asset on first use

        return demo_rows(source)
    if isinstance(source, (str, os.PathLike)):
        return _load_file(Path(source), lenient_json)
    import datasets

    if isinstance(source, datasets.Dataset):
        return source, 0
    if isinstance(source, datasets.DatasetDict):
        raise TypeError(
            f"source is a DatasetDict with splits {list(source)}; pass one split, e.g. ds['train']"
        )
    raise TypeError(f"unsupported source type {type(source).__name__}; expected a path, Dataset or list")


def build_examples(
    source: object,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    overlong: Overlong = "truncate",
    strict: bool = False,
    lenient_json: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[datasets.Dataset, Summary]:
    """Tokenized examples with loss masks, in row order, and a Summary of every row's fate.

    ``overlong``: ``"truncate"`` cuts examples to ``max_length`` (dropping those left without a
    loss token), ``"drop"`` rejects them. ``strict=True`` raises ``ValueError("row N: reason:
    ...")`` at the first bad row instead of skipping it (also when the result comes from cache).
    ``lenient_json``: see ``load_rows``. ``cache_dir=None`` uses ``default_cache_dir()``.
    """
    import datasets

    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong={overlong!r}; expected 'truncate' or 'drop'")
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r}; expected a positive int")

    rows, bytes_ignored = None, 0
    if _is_file_source(source) or (isinstance(source, str) and source.startswith(DEMO_PREFIX)):
        data_fingerprint = source_fingerprint(source)  # no parsing needed on a cache hit
    else:
        rows, bytes_ignored = _load_rows(source, lenient_json)
        data_fingerprint = _rows_fingerprint(rows)
    key_parts = {
        "data": data_fingerprint,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": {"max_length": max_length, "overlong": overlong, "lenient_json": lenient_json},
        "code": _code_version(),
    }
    key = _digest(json.dumps(key_parts, sort_keys=True))[:24]
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / key

    if _intact(path):
        summary = Summary(**json.loads((path / "summary.json").read_text()))
        summary.cache_hit = True
    else:
        if rows is None:
            rows, bytes_ignored = _load_rows(source, lenient_json)
        columns, summary = _encode_rows(rows, tokenizer, max_length, overlong, strict)
        summary.bytes_ignored = bytes_ignored
        if not summary.examples_out:  # nothing to train on (and datasets cannot reload 0 rows)
            raise ValueError(f"no examples out of {summary.rows_in} rows:\n{summary}")
        features = datasets.Features(
            {
                "input_ids": datasets.Sequence(datasets.Value("int32")),
                "loss_mask": datasets.Sequence(datasets.Value("int8")),
            }
        )
        _save(datasets.Dataset.from_dict(columns, features=features), summary, key_parts, path)
    summary.cache_path = str(path)
    if strict and summary.first_error:
        raise ValueError(summary.first_error)
    return datasets.load_from_disk(str(path / "dataset")), summary


def source_fingerprint(source: object, lenient_json: bool = False) -> str:
    """A hash of a data source's content: a demo asset's pinned sha256 and split rule, a file's or folder's
    bytes, else the rows themselves (``stdlib:*``, a Dataset or a list of rows)."""
    if isinstance(source, str) and source.startswith(DEMO_PREFIX):
        from draftsmith.data.assets import demo_fingerprint

        return demo_fingerprint(source)
    if _is_file_source(source):
        return _file_fingerprint(Path(source))
    return _rows_fingerprint(_load_rows(source, lenient_json)[0])


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of everything that changes token ids or masks: vocab, merges, normalizer,
    pre-tokenizer, added tokens, special-token names (templates read them) and chat template."""
    if not tokenizer.is_fast:
        raise TypeError(f"the data pipeline needs a fast tokenizer; got {type(tokenizer).__name__}")
    parts = [
        type(tokenizer).__name__,
        tokenizer.backend_tokenizer.to_str(),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True),
        json.dumps(tokenizer.chat_template, sort_keys=True),
    ]
    return _digest("\0".join(parts))


def _encode_rows(
    rows: Iterable[object],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    overlong: Overlong,
    strict: bool,
) -> tuple[dict[str, list[list[int]]], Summary]:
    columns: dict[str, list[list[int]]] = {"input_ids": [], "loss_mask": []}
    summary = Summary()
    skipped: Counter[str] = Counter()
    normalized: Counter[str] = Counter()
    method: Method | None = None  # resolved at the first conversation row
    for index, row in enumerate(rows):
        summary.rows_in += 1
        repairs: Counter[str] = Counter()  # counted only for rows that are kept
        try:
            sample = normalize_row(row, repairs)
            if isinstance(sample, str):
                ids, mask = encode_text(tokenizer, sample, row.get("token_ids"))
            else:
                method = method or mask_method(tokenizer)
                ids, mask = encode_conversation(tokenizer, sample, method, repairs)
            truncated = len(ids) > max_length
            if truncated and overlong == "drop":
                raise RowError(OVERLONG, f"{len(ids)} tokens > max_length={max_length}")
            if truncated:
                ids, mask = ids[:max_length], mask[:max_length]
                if not any(mask):
                    raise RowError(
                        NO_LOSS_AFTER_TRUNCATION, f"no loss token in the first {max_length} tokens"
                    )
        except RowError as err:
            message = f"row {index}: {err}"
            if strict:
                raise ValueError(message) from err
            skipped[err.reason] += 1
            summary.first_error = summary.first_error or message
            continue
        normalized.update(repairs)
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        summary.examples_out += 1
        summary.truncated += truncated
        summary.tokens += len(ids)
        summary.loss_tokens += sum(mask)
    summary.skipped = {reason: skipped[reason] for reason in REASONS if skipped[reason]}
    summary.mask_method = method
    summary.normalized = dict(sorted(normalized.items()))
    return columns, summary


def _intact(path: Path) -> bool:
    """Whether the cache entry ``path`` is complete and every file still as written (``files.json``); a
    damaged entry (ours: named by its key) is said and removed, to be made again."""
    if not (path / "summary.json").is_file():
        return False
    try:
        changed = changed_files(path, json.loads((path / "files.json").read_text()))
    except (OSError, ValueError, AttributeError):
        changed = ["files.json"]
    if not changed:
        return True
    logger.warning("the cached data %s is damaged (%s missing or changed since it was written): making it again",
                   path, ", ".join(changed))
    shutil.rmtree(path)
    return False


def _save(dataset: datasets.Dataset, summary: Summary, key_parts: dict, path: Path) -> None:
    """Write to a private temp dir, then rename: readers never see a half-written entry. ``files.json``,
    written last, records every other file (``_intact`` checks it on every use)."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    dataset.save_to_disk(str(tmp / "dataset"))
    record = {k: v for k, v in asdict(summary).items() if k not in ("cache_hit", "cache_path")}
    (tmp / "key.json").write_text(json.dumps(key_parts, indent=1, sort_keys=True))
    (tmp / "summary.json").write_text(json.dumps(record, indent=1))
    (tmp / "files.json").write_text(json.dumps(folder_digests(tmp), indent=1))
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "summary.json").is_file():  # not a concurrent writer of the same key
            raise
        shutil.rmtree(tmp)


def _load_file(path: Path, lenient_json: bool = False) -> tuple[list[dict] | datasets.Dataset, int]:
    if path.is_dir():
        return _load_dataset_dir(path), 0
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = []
        lines = path.read_bytes().split(b"\n")
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                if lenient_json and line_no == len(lines):  # a last line cut short (no newline after it)
                    return rows, len(line)
                raise ValueError(f"{path}:{line_no}: invalid JSON ({err})") from err
        return rows, 0
    if suffix == ".json":
        data, ignored = read_json(path, lenient_json)
        if isinstance(data, dict):
            lists = [k for k, v in data.items() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(
                    f"{path}: a JSON object must hold exactly one list of rows; list keys: {lists}"
                )
            data = data[lists[0]]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
        return data, ignored
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist(), 0
    raise ValueError(f"{path}: unsupported file type {suffix!r}; use .json, .jsonl or .parquet")


def _load_dataset_dir(path: Path) -> datasets.Dataset:
    """A ``datasets.Dataset`` saved with ``save_to_disk`` (a folder with state.json and arrow files)."""
    import datasets

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{path} holds a DatasetDict with splits {splits}; name one split's folder, e.g. "
                         f"{path / (splits[0] if splits else 'train')}")
    if not (path / "state.json").is_file():
        raise ValueError(f"{path} is a directory but not a `datasets` dataset: a data directory must be a "
                         "Dataset.save_to_disk folder (state.json, dataset_info.json, *.arrow); otherwise pass a "
                         ".json, .jsonl or .parquet file")
    return datasets.load_from_disk(str(path))


def _is_file_source(source: object) -> bool:
    if isinstance(source, str):
        return not source.startswith(("stdlib:", DEMO_PREFIX))
    return isinstance(source, os.PathLike)


def _file_fingerprint(path: Path) -> str:
    if path.is_dir():  # a save_to_disk folder: every file's name and bytes
        h = hashlib.sha256(b"dir")
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
        return h.hexdigest()
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    h = hashlib.sha256(path.suffix.lower().encode())  # the suffix decides how the bytes are parsed
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _rows_fingerprint(rows: Iterable) -> str:
    h = hashlib.sha256()
    for row in rows:
        # default=repr: Parquet/datasets rows may hold values json cannot write (dates, bytes)
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()


def _code_version() -> dict[str, str]:
    """This pipeline's own source plus the libraries that render and tokenize."""
    import datasets
    import tokenizers
    import transformers

    here = Path(__file__).parent
    source = _digest("".join((here / name).read_text(encoding="utf-8") for name in _CODE_FILES))
    return {
        "source": source,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "datasets": datasets.__version__,
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
