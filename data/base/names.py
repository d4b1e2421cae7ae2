"""How targets are named: ``demo:<name>``, Hugging Face Hub ids, and local paths.

Pure string rules, shared by every entry point that takes a target and by the cards and exports that
name one (which must never print a path of this machine)."""
from __future__ import annotations

import re
from pathlib import Path

DEMO_PREFIX = "demo:"  # demo:<size> demo LMs, demo:smollm2, and named data sets (demo:sharegpt, ...)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # name or namespace/name
_HF_CACHE_SNAPSHOT = re.compile(r".*/models--([^/]+)--([^/]+)/snapshots/[^/]+/?")
_DEMO_DIR = re.compile(r".*/demo/([a-z0-9-]+)-seed0-[0-9a-f]{12}/?")  # data.demo's cache layout


def is_demo(name: str) -> bool:
    """True for ``demo:<name>``."""
    return str(name).startswith(DEMO_PREFIX)


def looks_like_path(name: str) -> bool:
    """True for strings that cannot be a Hub repo id (``./x``, ``/abs``, ``~/x``, ``a/b/c``)."""
    return not HUB_ID.fullmatch(name) or name.startswith((".", "~", "/"))


def public_target_name(name_or_path: str | None) -> str | None:
    """How a card or an export may name a target: a Hub id or ``demo:<size>`` as given, a Hugging Face
    cache snapshot as its repo id, a draftsmith demo LM as ``demo:<size>``; None for any other local
    path (a path of this machine means nothing elsewhere and says who and where)."""
    name = str(name_or_path or "")
    if is_demo(name):
        return name
    if HUB_ID.fullmatch(name) and not name.startswith((".", "~")) and not Path(name).exists():
        return name
    if match := _HF_CACHE_SNAPSHOT.fullmatch(name):
        return f"{match.group(1)}/{match.group(2)}"
    if match := _DEMO_DIR.fullmatch(name):
        return f"{DEMO_PREFIX}{match.group(1)}"
    return None


# Set on the config of a PEFT adapter target once merged (data.targets.load_target): the base model's name.
ADAPTER_BASE_KEY = "adapter_base_name_or_path"

# The head kinds by name, for what must answer without loading torch (``draftsmith train --help``); the head
# classes themselves are heads.kinds.HEAD_CLASSES, whose keys tests/test_cli_entry.py holds equal to these
HEAD_KINDS = ("medusa", "eagle", "eagle3", "dflash", "early-exit", "mtp")
HEAD_MODEL_TYPE_PREFIX = "draftsmith_"  # every draftsmith head's config.json model_type starts with it


def is_head_model_type(model_type: object) -> bool:
    """Whether a config.json ``model_type`` names a draftsmith head (of any kind, present or future)."""
    return isinstance(model_type, str) and model_type.startswith(HEAD_MODEL_TYPE_PREFIX)


# The engine formats a head exports to: the keys of heads.formats.FORMATS (tests/scripts/test_cli_entry.py checks),
# here so that the export and push commands check --to/--format before torch loads.
EXPORT_FORMATS = ("vllm", "sglang", "speculators", "eagle-vllm", "medusa-vllm", "medusa-tgi", "dflash", "dspark", "mtp")

# The precisions stored features take: the keys of data.feature_store.DTYPES (tests/scripts/test_cli_entry.py checks), here
# so that scripts/dump_features.py and scripts/cost.py check --dtype/--feature-dtype before torch loads.
FEATURE_DTYPES = ("float32", "bfloat16", "float16", "fp8")

# The demo LM sizes: the keys of data.demo_lm.SIZES (tests/scripts/test_cli_entry.py checks), here so that
# scripts/make_demo_target.py checks --size before torch loads.
DEMO_SIZES = ("tiny", "small", "assistant", "tiny-hybrid")
