"""Read a ``torch.save``'d state dict (``pytorch_model.bin``) without unpickling it.

Such a file is a zip archive: raw tensor storages under ``<archive>/data/<key>`` and a pickle,
``<archive>/data.pkl``, that says which tensor is which. Unpickling runs whatever the pickle names
(``torch.load`` with ``weights_only=True`` only restricts what it may run); we never run it. The pickle's
opcodes are read with ``pickletools.genops`` (a disassembler: it decodes, it executes nothing) and
interpreted by a small stack machine that knows the one shape a state dict has — a dict (or
``OrderedDict``) of ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, …)`` with
storages named by persistent ids ``("storage", torch.<Type>Storage, key, location, numel)``.
Any other global, opcode or shape is refused in one line naming the file; nothing is imported or
called on the file's behalf. The EAGLE authors publish their heads in this format.
"""
from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
# The globals a state dict's pickle names, and what each stands for here (nothing is imported).
ORDERED_DICT, REBUILD_TENSOR = ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2")


class _Mark:
    """The stack's MARK sentinel."""


class _Global:
    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _Storage:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


def _pop_mark(stack: list[Any]) -> list[Any]:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _Mark:
            items = stack[i + 1:]
            del stack[i:]
            return items
    raise ValueError("MARK missing")


def _global(arg: str) -> _Global:
    module, _, name = arg.partition(" ")
    if (module, name) in (ORDERED_DICT, REBUILD_TENSOR) or (module == "torch" and name in STORAGE_DTYPES):
        return _Global(module, name)
    raise ValueError(f"it names {module}.{name}, which a plain state dict does not hold")


def _call(func: Any, args: tuple, storages: dict[str, Tensor] | None) -> Any:
    """What a REDUCE of ``func(*args)`` stands for; ``storages`` None: the first pass (no tensor built)."""
    if not isinstance(func, _Global):
        raise ValueError("it calls something that is not a known global")
    if (func.module, func.name) == ORDERED_DICT:
        if args:
            raise ValueError("an OrderedDict built with arguments")
        return {}
    if (func.module, func.name) == REBUILD_TENSOR:
        if len(args) < 4 or not isinstance(args[0], _Storage):
            raise ValueError("a tensor rebuilt from something other than a storage")
        if storages is None:
            return None
        storage, offset, size, stride = args[:4]
        flat = storages[storage.key]
        if not all(isinstance(v, int) for v in (offset, *size, *stride)):
            raise ValueError("a tensor with a non-integer size, stride or offset")
        extent = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else offset
        if offset < 0 or extent > flat.numel():
            raise ValueError(f"a tensor of size {tuple(size)} past the end of storage {storage.key}")
        return flat.as_strided(tuple(size), tuple(stride), offset).clone()
    raise ValueError(f"it calls {func.module}.{func.name}")


def _storages(archive: zipfile.ZipFile, prefix: str, wanted: dict[str, _Storage]) -> dict[str, Tensor]:
    out = {}
    for key, storage in wanted.items():
        raw = archive.read(f"{prefix}data/{key}")
        itemsize = torch.empty(0, dtype=storage.dtype).element_size()
        if len(raw) != storage.numel * itemsize:
            raise ValueError(f"storage {key} holds {len(raw)} bytes, not {storage.numel} × {itemsize}")
        out[key] = torch.frombuffer(bytearray(raw), dtype=storage.dtype) if raw else torch.empty(0, dtype=storage.dtype)
    return out


def _interpret(program: bytes, archive: zipfile.ZipFile, prefix: str) -> Any:
    """Run the pickle's opcodes on our stack machine (two passes: first collect the storages the
    tensors live in, then build)."""
    wanted: dict[str, _Storage] = {}
    result = _run(program, wanted, None)
    if result is not None:
        return result
    return _run(program, wanted, _storages(archive, prefix, wanted))


def _run(program: bytes, wanted: dict[str, _Storage], storages: dict[str, Tensor] | None) -> Any:
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(program):
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            return stack.pop() if storages is not None else None
        if name == "MARK":
            stack.append(_Mark)
        elif name in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8", "BININT", "BININT1", "BININT2",
                      "LONG1", "LONG4", "BINFLOAT", "INT"):
            stack.append(arg)
        elif name in ("NEWTRUE", "NEWFALSE", "NONE"):
            stack.append({"NEWTRUE": True, "NEWFALSE": False, "NONE": None}[name])
        elif name in ("GLOBAL",):
            stack.append(_global(arg))
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name == "TUPLE":
            stack.append(tuple(_pop_mark(stack)))
        elif name == "EMPTY_DICT":
            stack.append({})
        elif name == "EMPTY_LIST":
            stack.append([])
        elif name in ("SETITEM", "SETITEMS"):
            items = [stack.pop(), stack.pop()][::-1] if name == "SETITEM" else _pop_mark(stack)
            target = stack[-1]
            if not isinstance(target, dict):
                raise ValueError("items set on something that is not a dict")
            for key, value in zip(items[::2], items[1::2]):
                target[key] = value
        elif name in ("APPEND", "APPENDS"):
            items = [stack.pop()] if name == "APPEND" else _pop_mark(stack)
            if not isinstance(stack[-1], list):
                raise ValueError("items appended to something that is not a list")
            stack[-1].extend(items)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo[int(arg)])
        elif name == "BINPERSID":
            pid = stack.pop()
            if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
                    and pid[1].name in STORAGE_DTYPES and isinstance(pid[2], str) and isinstance(pid[4], int)):
                raise ValueError(f"a persistent id that is not a storage: {pid!r:.80}")
            storage = _Storage(STORAGE_DTYPES[pid[1].name], pid[2], pid[4])
            wanted.setdefault(storage.key, storage)
            stack.append(storage)
        elif name == "REDUCE":
            args, func = stack.pop(), stack.pop()
            stack.append(_call(func, args, storages))
        elif name == "BUILD":  # OrderedDict's _metadata (state) is dropped; only a dict may be built
            stack.pop()
            if storages is not None and not isinstance(stack[-1], dict):
                raise ValueError("BUILD on something that is not a dict")
        else:
            raise ValueError(f"opcode {name} is not part of a state dict")
    raise ValueError("no STOP opcode")


def read_torch_bin(path: str | Path) -> dict[str, Tensor]:
    """The tensors of a ``torch.save``'d state dict, read without unpickling; one-line errors."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1:
                raise ValueError("not a torch zip archive with one data.pkl")
            prefix = pickles[0][: -len("data.pkl")]
            order = f"{prefix}byteorder"
            if order in archive.namelist() and archive.read(order).strip() not in (b"little",):
                raise ValueError("big-endian storages")
            state = _interpret(archive.read(pickles[0]), archive, prefix)
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not a zip archive (a legacy torch.save file, which only unpickling "
                         "reads; convert it to safetensors where you trust it)") from None
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"{path}: not a plain state dict of tensors ({err})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: not a plain state dict of tensors (a {type(state).__name__})")
    return state
