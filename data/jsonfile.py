"""Reading JSON data files, strictly or leniently (a truncated top-level array yields its complete rows)."""
from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path, lenient: bool = False) -> tuple[object, int]:
    """``(value, bytes ignored)`` of a JSON file. Invalid JSON raises ``ValueError`` naming the
    file and the byte offset; with ``lenient=True`` a top-level array that is cut off (a download
    or dump that stopped mid-row) yields its complete rows and the number of bytes after them."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:  # a cut inside a multi-byte character
        if not lenient:
            raise ValueError(f"{path}: not UTF-8 at byte offset {err.start} ({err.reason})") from err
        text = raw[: err.start].decode("utf-8")
    try:
        return json.loads(text), len(raw) - len(text.encode("utf-8"))
    except json.JSONDecodeError as err:
        offset = len(text[: err.pos].encode("utf-8"))
        if not lenient:
            raise ValueError(
                f"{path}: invalid JSON at byte offset {offset} of {len(raw)} (line {err.lineno}, column "
                f"{err.colno}): {err.msg}; if the file is a truncated JSON array, data.lenient_json=true "
                "reads its complete rows") from err
    rows, end = _complete_array_prefix(text, path)
    return rows, len(raw) - len(text[:end].encode("utf-8"))



def _complete_array_prefix(text: str, path: Path) -> tuple[list, int]:
    """The complete elements of a JSON array cut off after them, and the character offset where
    the last complete element ends."""
    decoder = json.JSONDecoder()
    ws = " \t\n\r"
    i = len(text) - len(text.lstrip(ws))
    if not text.startswith("[", i):
        raise ValueError(f"{path}: invalid JSON that is not a truncated array (it does not start with '['); "
                         "data.lenient_json reads only cut-off arrays of rows")
    rows, i, end = [], i + 1, i + 1
    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        try:
            row, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            if err.pos < len(text) and text[err.pos:].strip(ws):
                # an error before the end of the text: the file is broken, not just cut off
                if not _cut_inside(text, i, decoder):
                    offset = len(text[: err.pos].encode("utf-8"))
                    raise ValueError(f"{path}: invalid JSON at byte offset {offset} inside the array "
                                     f"(row {len(rows)}): {err.msg}; data.lenient_json only skips a cut-off "
                                     "last row") from err
            return rows, end
        rows.append(row)
        end = i
        while i < len(text) and text[i] in ws:
            i += 1
        if i >= len(text):
            return rows, end
        if text[i] != ",":
            offset = len(text[:i].encode("utf-8"))
            raise ValueError(f"{path}: invalid JSON at byte offset {offset}: expected ',' after row {len(rows) - 1}")
        i += 1



def _cut_inside(text: str, start: int, decoder: json.JSONDecoder) -> bool:
    """Whether the element starting at ``start`` fails only because the text ends inside it: then
    closing every open string, object and array would not fail earlier than the end."""
    depth, in_string, escape = [], False, False
    for ch in text[start:]:
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth.append(ch)
        elif ch in "]}":
            if not depth:
                return False
            depth.pop()
            if not depth:
                return False  # the element closed, so it failed for another reason
    return bool(depth) or in_string
