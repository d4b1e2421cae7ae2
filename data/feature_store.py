"""A folder of stored target hidden states (issue 19): written once by ``scripts/dump_features.py`` or
filled during a run's first epoch (``data.feature_cache``), read instead of the target's forward.

Layout of ``DIR``::

    .draftsmith-features        written first: what the states were made from (the fingerprint) and
                                the storage dtype; a folder without it is never written into
    manifest-<writer>.json      one per writer (``dump``, ``rank0``, ...): its shards with their rows,
                                size and sha256; rewritten atomically after each shard
    <writer>-<n>.safetensors    rows concatenated along tokens: row_ids (R,), offsets (R+1,),
                                input_ids, loss_mask (N,), final (N, H) and aux (N, k·H) when stored,
                                with final_scale / aux_scale (N,) for fp8

A shard is saved under a temporary name and renamed, then listed in its manifest: a writer killed at
any moment leaves listed shards whole and an unlisted one that is written again. A row listed twice
(it cannot be, but) is read from its first shard.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from draftsmith.data.base.checks import indices
from draftsmith.data.base.paths import file_digest, share_readable

MARKER = ".draftsmith-features"
FORMAT_VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class FeatureStoreError(ValueError):
    """A feature folder that cannot be used as asked; the message names the folder."""


def encode(name: str, x: Tensor, dtype: str) -> dict[str, Tensor]:
    """``x`` (N, D) as stored: cast to ``dtype``; fp8 with one float32 scale per token (row of ``x``)
    so that each token's largest entry maps to the format's largest finite value."""
    if dtype != "fp8":
        return {name: x.to(DTYPES[dtype]).contiguous()}
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
    return {name: (x.float() / scale[:, None]).to(torch.float8_e4m3fn).contiguous(),
            f"{name}_scale": scale.contiguous()}


def decode(values: Tensor, scale: Tensor | None) -> Tensor:
    """Stored values (N, D) back to float32."""
    out = values.float()
    return out if scale is None else out * scale.float()[:, None]


def bytes_per_token(widths: dict[str, int], dtype: str) -> int:
    """Disk bytes one token takes: ``widths`` {"final": H, "aux": k·H}, plus input_ids (8) and loss_mask (1);
    fp8 adds one float32 scale per stored vector. Shared by the dump's estimate and the cost planner."""
    if dtype not in DTYPES:
        raise ValueError(f"feature dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    bad = {k: w for k, w in widths.items() if w < 0}
    if bad:
        raise ValueError(f"feature widths must be >= 0, got {bad}")
    scale = 4 if dtype == "fp8" else 0
    return 9 + sum(w * DTYPES[dtype].itemsize + scale for w in widths.values())


def state_widths(hidden_size: int, aux_layers: int) -> dict[str, int]:
    """What a dump stores per token for a head kind reading ``aux_layers`` aux states (0: the final only)."""
    return {"final": hidden_size, **({"aux": aux_layers * hidden_size} if aux_layers else {})}


def _atomic_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def first_difference(stored: dict, current: dict) -> str | None:
    """``"key: stored X, now Y"`` for the first key whose values differ, else None."""
    for key in sorted(set(stored) | set(current)):
        if stored.get(key) != current.get(key):
            return f"{key}={stored.get(key)!r} there, {current.get(key)!r} here"
    return None


def read_manifest(path: Path) -> dict:
    """A writer's manifest; a cut or malformed one is refused naming the file."""
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list) or not all(
                isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("bytes"), int)
                for s in manifest["shards"]):
            raise ValueError('expected {"shards": [{"file", "bytes", "sha256", ...}, ...]}')
    except ValueError as err:
        raise FeatureStoreError(f"{path}: not a feature manifest ({err}); the folder is damaged "
                                "(a writer cut off mid-write leaves none: store the features again)") from None
    return manifest


def check_shard(file: Path, rows: list[int], offsets: list[int], shapes: dict[str, list[int]],
                fingerprint: dict) -> None:
    """The numbers a shard carries and the reader indexes with, checked against the folder's
    fingerprint (the target and data it was made for) when the shard is indexed: row ids in
    [0, data.rows), offsets from 0 rising to the token count, every state (tokens, hidden_size) or
    (tokens, aux layers x hidden_size)."""
    for key in ("input_ids", "loss_mask", "row_ids", "offsets", "final"):  # what every writer stores
        if key not in shapes:
            raise FeatureStoreError(f"{file}: holds no {key}; the folder is damaged")
    tokens = shapes["input_ids"][0] if shapes["input_ids"] else -1
    try:
        if fingerprint.get("data.rows") is not None:
            indices("row_ids", rows, fingerprint["data.rows"], file, "the data's rows")
        if len(offsets) != len(rows) + 1 or offsets[:1] != [0] or offsets[-1] != tokens \
                or any(a > b for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"{file}: offsets must rise from 0 to the {tokens} stored tokens, one per row and one more "
                             f"({len(rows)} rows); got {len(offsets)} offsets ending at {offsets[-1:]}")
        hidden, aux = fingerprint.get("target.hidden_size"), len(fingerprint.get("aux_layer_ids") or ())
        widths = {"final": hidden, "aux": aux * hidden if hidden else None}
        for key, shape in shapes.items():
            if key in ("row_ids", "offsets"):
                continue
            want = [tokens] + ([widths[key]] if key in widths else [])
            if len(shape) != len(want) or any(w is not None and s != w for s, w in zip(shape, want)):
                raise ValueError(f"{file}: {key} has shape {shape}; the folder's target and tokens give "
                                 f"{['?' if w is None else w for w in want]}")
    except ValueError as err:
        raise FeatureStoreError(f"{err}; the folder is damaged") from None


class FeatureStore:
    """Rows of stored hidden states in ``path``: ``read`` them, ``add`` more (buffered into shards of
    about ``shard_bytes``). ``open_store`` makes or checks the folder."""

    def __init__(self, path: Path, writer: str | None = None, shard_bytes: int = 512 << 20) -> None:
        self.path, self.writer, self.shard_bytes = Path(path), writer, shard_bytes
        marker = json.loads((self.path / MARKER).read_text())
        self.fingerprint, self.dtype = marker["fingerprint"], marker["dtype"]
        self.index: dict[int, tuple[str, int]] = {}  # row -> (shard file, position in it)
        self.offsets: dict[str, list[int]] = {}
        self.known: set[str] = set()
        self.listed: dict[str, tuple[str, str | None]] = {}  # shard -> (its manifest, the sha256 listed there)
        self.verified: set[str] = set()  # shards whose bytes matched their listed sha256 in this process
        self.manifest = {"writer": writer, "shards": []}
        self._buffer: list[dict[str, Tensor]] = []
        self._buffered = 0
        self.pending: set[int] = set()  # rows added but not yet in a written shard
        self.refresh()
        if writer is not None and (self.path / f"manifest-{writer}.json").is_file():
            self.manifest = read_manifest(self.path / f"manifest-{writer}.json")
        for stray in self.path.glob(f".{writer}-*.tmp") if writer else ():  # a shard cut off by a kill
            stray.unlink()

    # ------------------------------------------------------------ reading

    def refresh(self) -> None:
        """Index the shards every writer has listed so far (each checked for its listed size)."""
        for manifest in sorted(self.path.glob("manifest-*.json")):
            for shard in read_manifest(manifest)["shards"]:
                name = shard["file"]
                if name in self.known:
                    continue
                file = self.path / name
                if not file.is_file() or file.stat().st_size != shard["bytes"]:
                    raise FeatureStoreError(f"{file}: listed in {manifest.name} with {shard['bytes']} bytes but "
                                            f"{'missing' if not file.is_file() else 'changed'}; the folder is damaged")
                try:
                    with safe_open(str(file), "pt") as f:
                        rows = f.get_tensor("row_ids").tolist()
                        offsets = f.get_tensor("offsets").tolist()
                        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
                except Exception as err:  # noqa: BLE001 - safetensors raises its own types for a damaged header
                    raise FeatureStoreError(f"{file}: not a readable feature shard ({type(err).__name__}: {err}); "
                                            "the folder is damaged") from None
                check_shard(file, rows, offsets, shapes, self.fingerprint)
                self.offsets[name] = offsets
                self.listed[name] = (manifest.name, shard.get("sha256"))
                for position, row in enumerate(rows):
                    self.index.setdefault(row, (name, position))
                self.known.add(name)

    def verify(self, name: str) -> None:
        """Check shard ``name`` against the sha256 its manifest lists, once per process, before its first
        read: a changed byte (same size) is refused, never trained on. Costs one read of the shard
        (docs/features.md: seconds per GB)."""
        if name in self.verified:
            return
        manifest, recorded = self.listed[name]
        if recorded is not None:
            actual = file_digest(self.path / name)["sha256"]
            if actual != recorded:
                raise FeatureStoreError(f"{self.path / name}: sha256 {actual[:16]}... differs from the "
                                        f"{recorded[:16]}... listed in {manifest}; the folder is damaged: store the "
                                        "features again in a new folder")
        self.verified.add(name)

    def __len__(self) -> int:
        return len(self.index)

    def has(self, rows: list[int]) -> bool:
        return all(r in self.index for r in rows)

    def read(self, rows: list[int]) -> list[dict[str, Tensor]]:
        """Each row's {"input_ids", "loss_mask", "final"[, "aux"]} (float32 states, (T_row, D))."""
        out = []
        for row in rows:
            if row not in self.index:
                raise FeatureStoreError(f"{self.path} holds no row {row} (it holds {len(self.index)} rows)")
            name, position = self.index[row]
            self.verify(name)
            start, end = self.offsets[name][position: position + 2]
            with safe_open(str(self.path / name), "pt") as f:  # memory-mapped: reads only this row's slice
                keys = set(f.keys())
                item = {k: f.get_slice(k)[start:end] for k in ("input_ids", "loss_mask")}
                for k in ("final", "aux"):
                    if k in keys:
                        scale = f.get_slice(f"{k}_scale")[start:end] if f"{k}_scale" in keys else None
                        item[k] = decode(f.get_slice(k)[start:end], scale)
            out.append(item)
        return out

    # ------------------------------------------------------------ writing

    def add(self, row: int, input_ids: Tensor, loss_mask: Tensor, states: dict[str, Tensor]) -> None:
        """Buffer one row (``states``: "final" (T, H) and maybe "aux" (T, k·H)); a shard is written when
        the buffer reaches ``shard_bytes``."""
        item = {"row": row, "input_ids": input_ids.detach().cpu().long(),
                "loss_mask": loss_mask.detach().cpu().to(torch.uint8),
                **{k: v.detach().cpu() for k, v in states.items()}}
        self._buffer.append(item)
        self.pending.add(row)
        self._buffered += len(input_ids) * bytes_per_token({k: v.shape[-1] for k, v in states.items()}, self.dtype)
        if self._buffered >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one shard and list it (nothing when the buffer is empty)."""
        if not self._buffer:
            return
        rows = self._buffer
        lengths = [len(r["input_ids"]) for r in rows]
        tensors = {"row_ids": torch.tensor([r["row"] for r in rows], dtype=torch.long),
                   "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long),
                   "input_ids": torch.cat([r["input_ids"] for r in rows]),
                   "loss_mask": torch.cat([r["loss_mask"] for r in rows])}
        for k in ("final", "aux"):
            if k in rows[0]:
                tensors.update(encode(k, torch.cat([r[k] for r in rows]), self.dtype))
        name = f"{self.writer}-{len(self.manifest['shards']):05d}.safetensors"
        tmp = self.path / f".{self.writer}-{len(self.manifest['shards']):05d}.tmp"
        save_file(tensors, str(tmp))
        share_readable(tmp)  # save_file writes 0600
        os.replace(tmp, self.path / name)  # whole or absent: a kill leaves no half shard under its name
        self.manifest["shards"].append({"file": name, "rows": len(rows), "tokens": sum(lengths),
                                        **file_digest(self.path / name)})
        _atomic_json(self.path / f"manifest-{self.writer}.json", self.manifest)
        self._buffer, self._buffered = [], 0
        self.pending.clear()
        self.refresh()
        self.verified.add(name)  # hashed as it was written, just now

    def disk_bytes(self) -> int:
        return sum((self.path / name).stat().st_size for name in self.known)


def open_store(path: str | Path, fingerprint: dict, *, key: str, dtype: str | None = None, create: bool = False,
               writer: str | None = None, shard_bytes: int = 512 << 20) -> FeatureStore:
    """The feature folder ``path`` for this ``fingerprint``; ``key`` names the setting that chose it.

    ``create``: an absent or empty folder is made ours (marker first) for ``dtype``; otherwise the folder
    must already be ours. A folder with other files, or made for another fingerprint or dtype, is
    refused in one line naming the first differing key; nothing in it is changed.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FeatureStoreError(f"{key}={path} is a file, not a feature folder")
    empty = not path.is_dir() or not any(path.iterdir())
    if empty:
        if not create:
            raise FeatureStoreError(f"{key}={path}: no stored features there (write them with "
                                    "scripts/dump_features.py --out DIR)")
        path.mkdir(parents=True, exist_ok=True)
        _atomic_json(path / MARKER, {"format": "draftsmith-features", "version": FORMAT_VERSION,
                                     "dtype": dtype, "fingerprint": fingerprint})
    elif not (path / MARKER).is_file():
        names = sorted(p.name for p in path.iterdir())[:5]
        raise FeatureStoreError(f"{key}={path} holds files no feature dump wrote ({', '.join(names)}); "
                                "draftsmith never writes into it: choose a new or empty folder")
    try:
        marker = json.loads((path / MARKER).read_text())
        stored, stored_dtype = marker["fingerprint"], marker["dtype"]
    except (ValueError, KeyError, TypeError) as err:
        raise FeatureStoreError(f"{path / MARKER}: unreadable ({err})") from None
    difference = first_difference(stored, fingerprint)
    if difference is not None:
        raise FeatureStoreError(f"{key}={path} was made for another target or config ({difference}); "
                                "use a new folder for this one")
    if dtype is not None and stored_dtype != dtype:
        raise FeatureStoreError(f"{key}={path} stores {stored_dtype} (asked: {dtype}); use a new folder for {dtype}")
    return FeatureStore(path, writer, shard_bytes)
