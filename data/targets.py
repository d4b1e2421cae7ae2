"""Where a target model comes from: ``demo:<size>``, a local directory, or a Hugging Face Hub id.

``resolve_target`` is what every entry point that takes a target calls (training, ``infer.generate``,
``SpeculativeGenerator.from_pretrained``, ``scripts/export.py``), so a demo name, a missing path and
an unreachable Hub give the same answer everywhere. ``hub_errors`` turns the Hub client's network
errors into one line naming the repo.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from data.base.names import HEAD_MODEL_TYPE_PREFIX, is_demo, is_head_model_type, looks_like_path
from data.jsonfile import read_json


class HubUnreachable(OSError):
    """The Hugging Face Hub could not be reached for a repo that is not in the local cache."""


def resolve_target(target: str | os.PathLike, role: str = "target") -> str:
    """A path or Hub id ``from_pretrained`` can load.

    ``demo:<size>`` is the demo LM of that size (built and cached on first use, which takes minutes;
    the builder is the demo recipe in ``data.demo``). A local-looking path that does not exist, and a
    directory without ``config.json``, raise ``FileNotFoundError`` naming it; a draftsmith head's
    directory raises ``ValueError``; anything else is a Hub id. ``role`` names the model in messages
    ("target", "draft LM").
    """
    target = str(target)
    if is_demo(target):
        from data.demo import demo_target_path  # imported only for demo names (it pulls in the builder)

        return demo_target_path(target)
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{role} {target}: the directory has no config.json (not a saved model)")
        _refuse_head(path, role)
        return str(path)
    if path.exists():
        raise FileNotFoundError(f"{role} {target}: is a file; pass the model's directory")
    if looks_like_path(target) or _local_parent(path):
        raise FileNotFoundError(f"{role} {target}: no such directory")
    return target


def _refuse_head(path: Path, role: str) -> None:
    """A draftsmith head's folder where a language model is expected: say so, before transformers
    answers with an unrecognized architecture."""
    try:
        model_type = read_json(path / "config.json")[0].get("model_type", "")
    except (ValueError, AttributeError):
        return  # not our business here: from_pretrained names a broken config
    if is_head_model_type(model_type):
        raise ValueError(f"{role} {path}: is a draftsmith {model_type.removeprefix(HEAD_MODEL_TYPE_PREFIX)} head, not a "
                         "language model; pass it as the head (--head) and its target model as the target")


def _local_parent(path: Path) -> bool:
    """``runs/x`` with a local ``runs/``: meant as a path, although it also reads as a Hub id."""
    return len(path.parts) > 1 and path.parent.is_dir()


def check_head_source(head: str | os.PathLike) -> None:
    """Refuse a local head path that does not exist or has no config.json, naming it."""
    path = Path(head).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"head {head}: the directory has no config.json (not a saved head; a training "
                                "run's output_dir holds one once training finished)")
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"head {head}: is a file; pass the head's directory")
    if not path.exists() and (looks_like_path(str(head)) or _local_parent(path)):
        raise FileNotFoundError(f"head {head}: no such directory")


@contextlib.contextmanager
def hub_errors(repo_id: str | os.PathLike, upload: bool = False) -> Iterator[None]:
    """Re-raise network failures of Hub calls as one ``HubUnreachable`` line naming ``repo_id``
    (``upload``: the message of a push, not of a load)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001  (re-raised unless it is a network failure)
        reason = _network_failure(err)
        if reason is None:
            raise
        if upload:
            raise HubUnreachable(f"{repo_id}: could not upload, the Hugging Face Hub is unreachable ({reason}); "
                                 "nothing was pushed, check the network and try again") from err
        raise HubUnreachable(f"{repo_id}: not a local directory, and the Hugging Face Hub is unreachable "
                             f"({reason}) with the repo not in the local cache; check the path or the network") from err


def _network_failure(err: BaseException) -> str | None:
    names = {cls.__name__ for cls in type(err).__mro__}
    if names & {"TransportError", "ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError"}:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, OSError) and "couldn't connect to" in str(err):  # transformers' message
        return "no connection"
    cause = err.__cause__ or err.__context__
    return _network_failure(cause) if cause is not None and cause is not err else None
