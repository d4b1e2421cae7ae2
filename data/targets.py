"""Where a target model comes from: ``demo:<size>``, a local directory, or a Hugging Face Hub id.

``resolve_target`` is what every entry point that takes a target calls (training, ``infer.generate_command``,
``SpeculativeGenerator.from_pretrained``, ``scripts/export.py``), so a demo name, a missing path and
an unreachable Hub give the same answer everywhere. ``hub_errors`` turns the Hub client's network
errors into one line naming the repo. ``load_target``/``load_target_tokenizer`` load what it names; a
PEFT adapter (a directory or Hub repo with ``adapter_config.json``) is loaded on its base and merged.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.data.base.checks import indices
from draftsmith.data.base.names import ADAPTER_BASE_KEY, HEAD_MODEL_TYPE_PREFIX, is_demo, is_head_model_type, looks_like_path
from draftsmith.data.jsonfile import read_json


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
        from draftsmith.data.demo import demo_target_path  # imported only for demo names (it pulls in the builder)

        return demo_target_path(target)
    path = Path(target).expanduser()
    if path.is_dir():
        if (path / ADAPTER_CONFIG).is_file():
            _check_adapter_files(path, role)
            return str(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{role} {target}: the directory has no config.json (not a saved model)")
        _refuse_head(path, role)
        return str(path)
    if path.exists():
        raise FileNotFoundError(f"{role} {target}: is a file; pass the model's directory")
    if looks_like_path(target) or _local_parent(path):
        raise FileNotFoundError(f"{role} {target}: no such directory")
    return target


ADAPTER_CONFIG = "adapter_config.json"  # peft's names for an adapter's config and weights
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _check_adapter_files(path: Path, role: str) -> None:
    """An adapter directory must hold safetensors weights: ``adapter_model.bin`` is a pickle."""
    if not (path / ADAPTER_WEIGHTS).is_file():
        found = "only adapter_model.bin (a pickle, never loaded here)" if (path / "adapter_model.bin").is_file() \
            else f"no {ADAPTER_WEIGHTS}"
        raise ValueError(f"{role} {path}: PEFT adapter with {found}; save it with "
                         "save_pretrained(..., safe_serialization=True)")


def check_adapter_layers(adapter: Path, num_layers: int) -> None:
    """An adapter's ``layers_to_transform`` (layer indices peft adapts) against its base's layers: an
    index past them would match no module of the base."""
    layers = read_json(adapter / ADAPTER_CONFIG)[0].get("layers_to_transform")
    if layers is not None:
        indices("layers_to_transform", [layers] if isinstance(layers, int) else layers, num_layers,
                adapter / ADAPTER_CONFIG, f"the base model's {num_layers} layers")


def adapter_source(target: str, role: str = "target") -> Path | None:
    """The local directory of a PEFT adapter named by ``target`` (a resolved target), or None for a
    full model. A Hub id is asked for ``adapter_config.json`` and, when it has one, only the adapter's
    json, safetensors and tokenizer files are downloaded; from there the path is the local one."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path if (path / ADAPTER_CONFIG).is_file() else None
    if _hub_adapter_config(target) is None:
        return None
    from huggingface_hub import snapshot_download

    with hub_errors(target):
        path = Path(snapshot_download(target, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    _check_adapter_files(path, role)
    return path


def _hub_adapter_config(repo: str) -> str | None:
    """The adapter config of a Hub repo, or None for a model repo (a model in the local cache is not
    asked for again; a missing repo is left to ``from_pretrained`` to report)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    cached = try_to_load_from_cache(repo, ADAPTER_CONFIG)
    if isinstance(cached, str):
        return cached
    if cached is not None or isinstance(try_to_load_from_cache(repo, "config.json"), str):
        return None  # known not to have one, or a full model already cached
    try:
        with hub_errors(repo):
            return hf_hub_download(repo, ADAPTER_CONFIG)
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
        return None


def adapter_base(adapter: Path) -> str:
    """The base model an adapter directory names (``base_model_name_or_path`` of its config)."""
    config = read_json(adapter / ADAPTER_CONFIG)[0]
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise ValueError(f"{adapter / ADAPTER_CONFIG}: no base_model_name_or_path (the model the adapter was made for)")
    return str(base)


def load_target(target: str, role: str = "target", **kwargs: Any):
    """``AutoModelForCausalLM.from_pretrained(target, **kwargs)`` for a resolved target; a PEFT adapter
    is loaded on its base (resolved the same way) with peft and merged into it (decoding then costs
    what the base costs). The merged model's ``config._name_or_path`` is the adapter as given and
    ``config.adapter_base_name_or_path`` its base, so heads, cards and exports can name both."""
    from transformers import AutoModelForCausalLM

    adapter = adapter_source(target, role)
    if adapter is None:
        with hub_errors(target):
            return AutoModelForCausalLM.from_pretrained(target, **kwargs)
    from peft import PeftModel

    base_name = adapter_base(adapter)
    base_path = resolve_target(base_name, role=f"base model of the adapter {target}")
    with hub_errors(base_path):
        base = AutoModelForCausalLM.from_pretrained(base_path, **kwargs)
    check_adapter_layers(adapter, base.config.num_hidden_layers)
    model = PeftModel.from_pretrained(base, str(adapter), is_trainable=False).merge_and_unload()
    model.config._name_or_path = str(target)
    setattr(model.config, ADAPTER_BASE_KEY, base_name)
    return model


def load_target_config(target: str):
    """The model config of a resolved target without its weights; an adapter's is its base's, named
    as ``load_target`` names the merged model."""
    from transformers import AutoConfig

    adapter = adapter_source(target)
    source = target if adapter is None else resolve_target(adapter_base(adapter), role=f"base model of the adapter {target}")
    with hub_errors(source):
        config = AutoConfig.from_pretrained(source)
    if adapter is not None:
        config._name_or_path = str(target)
        setattr(config, ADAPTER_BASE_KEY, adapter_base(adapter))
    return config


def load_target_tokenizer(target: str, **kwargs: Any):
    """The tokenizer of a resolved target: an adapter's own when it ships one, else its base's."""
    from transformers import AutoTokenizer

    source = str(target)
    adapter = adapter_source(source)
    if adapter is not None:
        source = str(adapter) if (adapter / "tokenizer_config.json").is_file() else \
            resolve_target(adapter_base(adapter), role=f"base model of the adapter {target}")
    with hub_errors(source):
        return AutoTokenizer.from_pretrained(source, **kwargs)


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
