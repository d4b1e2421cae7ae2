"""Typed training configuration: ``load_config`` fills the settings (``train/settings.py``) from YAML and
dotted ``key=value`` overrides and checks them.

Every value is checked against its field's type at parse time; bad values, unknown keys and invalid
combinations raise ``ConfigError`` naming the key. What depends on the head kind is asked of the kind:
its head config (``heads.HEAD_CLASSES``: its options, their ranges) and its training objective
(``train/objectives/<kind>.py``: the settings it ``reads``, and ``configure``, its defaults and checks).
This module names no kind.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from draftsmith.data.base.names import HEAD_KINDS
from draftsmith.train.settings import ConfigError, HeadConfig, TrainConfig, decode_tau_key, plain

# ---------------------------------------------------------------- parsing


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                default_file: bool = False, notes: list[str] | None = None, check: bool = True) -> TrainConfig:
    """A ``TrainConfig`` from a YAML file (optional) plus dotted ``key=value`` overrides.

    Override values are parsed as YAML scalars/flow values (``lr=3e-5``, ``head.aux_layer_ids=[1,2,3]``,
    ``data.eval=null``). ``default_file``: ``path`` is the default config the user did not choose, so
    its head and kind-specific train keys that the final ``head.kind`` does not read are dropped (one line in ``notes``)
    instead of refused; keys the user sets are always checked. ``check=False``: the keys and their types only, not
    the checks that load the head classes (torch): ``--help``'s values, shown in a second.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: invalid YAML ({err})") from err
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of keys, got {type(loaded).__name__}")
        raw = loaded or {}
    from_file = json_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.max_steps=100)")
        if not text.strip():  # "train.init_from=" read as null would drop a setting without a word
            raise ConfigError(f"{key}: empty value in {item!r}; write {key}=null to unset it")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: cannot parse value {text!r} ({err})") from err
        _set_dotted(raw, key.split("."), value, key)
    if default_file:
        dropped, reader = _drop_inapplicable(raw, from_file)
        if dropped and notes is not None:
            notes.append(f"{path}: ignoring {', '.join(dropped)}: not read by {reader}")
    if check:
        return from_dict(raw)
    cfg = _build(TrainConfig, raw, prefix="")
    cfg.output_dir = cfg.output_dir or default_output_dir(cfg)
    return cfg


def json_copy(tree: Any) -> Any:
    """A deep copy of plain nested dicts/lists."""
    if isinstance(tree, dict):
        return {k: json_copy(v) for k, v in tree.items()}
    return list(tree) if isinstance(tree, list) else tree


def _drop_inapplicable(raw: dict, from_file: dict) -> tuple[list[str], str]:
    """Remove head keys, and train keys some kinds' objectives declare (``train.labels``), that came from the
    file unchanged and that the final head kind and variant do not read; a ``head.variant`` of another kind than
    the file's, with ``head.kind`` left as the file has it, picks its kind. Returns the dropped keys and the
    head they are not read by."""
    head, file_head = raw.get("head"), from_file.get("head")
    if not isinstance(head, dict) or not isinstance(file_head, dict):
        return [], ""
    file_kind = file_head.get("kind", HeadConfig.kind)
    kind, variant = head.get("kind", HeadConfig.kind), head.get("variant")
    if kind == file_kind and isinstance(variant, str):  # the heads load (torch) only for a variant
        from draftsmith.heads.kinds import kind_of_variant

        if kind_of_variant(variant) not in (None, kind):
            head["kind"] = kind = kind_of_variant(variant)
    if (kind, variant) == (file_kind, file_head.get("variant")):  # the file's keys are for its own head: checked
        return [], ""
    dropped = []
    for name in [f.name for f in dataclasses.fields(HeadConfig) if f.name != "kind"]:
        if name not in file_head or head.get(name) != file_head[name] or head[name] is None:
            continue
        kinds = kinds_reading(name)
        if kind not in kinds:
            dropped.append(f"head.{name} ({'/'.join(kinds)} only)")
        elif not variant_reads(kind, variant, name):
            dropped.append(f"head.{name} (not head.variant={variant})")
        else:
            continue
        del head[name]
    train, file_train = raw.get("train"), from_file.get("train")
    for name in list(train) if isinstance(train, dict) and isinstance(file_train, dict) else []:
        kinds = kinds_reading_setting(f"train.{name}")
        if kinds and kind not in kinds and name in file_train and train[name] == file_train[name]:
            del train[name]
            dropped.append(f"train.{name} ({'/'.join(kinds)} only)")
    return dropped, f"head.kind={kind}" + (f" head.variant={variant}" if variant else "")


def variant_reads(kind: str, variant: str | None, name: str) -> bool:
    """Whether a ``kind`` head of ``variant`` reads ``head.<name>`` (its objective does, or its class takes it:
    ``heads.kinds.variant_options``); a variant no class builds reads what its kind does (its config refuses it)."""
    from draftsmith.heads.kinds import HEAD_CLASSES, variant_options

    variants = getattr(HEAD_CLASSES[kind].config_class, "variants", ())
    if name in training_keys() or (variant is not None and variant not in variants):
        return True
    return name in variant_options(kind, variant)


def from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build and validate a ``TrainConfig`` from nested plain values."""
    cfg = _build(TrainConfig, raw, prefix="")
    _validate(cfg)
    return cfg


def _set_dotted(tree: dict, parts: list[str], value: Any, key: str) -> None:
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    section = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'; valid keys in {section}: {', '.join(fields)}")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}{name}"
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if value is None:
                raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<key>=...")
            kwargs[name] = _build(hint, value, prefix=f"{key}.")
        else:
            kwargs[name] = _coerce(value, hint, key)
    return cls(**kwargs)  # from_dict validates the combination


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked (and minimally converted) against the annotation ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        if value is False and "no" in args:  # YAML 1.1 reads an unquoted no (and off, false) as false
            return "no"
        if value not in args:
            quote = " (YAML read an unquoted word as a boolean: quote it)" if isinstance(value, bool) else ""
            raise ConfigError(f"{key}: must be one of {', '.join(map(str, args))} (got {value!r}){quote}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and Ellipsis not in args:  # fixed length, e.g. tuple[float, float]
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        return origin(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "5e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported annotation {hint!r}")  # a bug in this file, not in the YAML




# ---------------------------------------------------------------- validation


def head_kinds() -> tuple[str, ...]:
    """Every head kind: the keys of ``heads.HEAD_CLASSES`` (the one list of kinds)."""
    from draftsmith.heads.auto import HEAD_CLASSES

    return tuple(HEAD_CLASSES)


def kinds_reading_setting(setting: str) -> tuple[str, ...]:
    """The head kinds whose training objective declares ``setting`` in ``Objective.reads`` (``head.ttt_steps``,
    ``train.gamma``, ``train.loss=dpace``)."""
    from draftsmith.train.objectives import objective_class

    return tuple(kind for kind in head_kinds() if setting in objective_class(kind).reads)


def training_keys() -> dict[str, tuple[str, ...]]:
    """The ``head.*`` keys a kind's training objective reads, not its head config (``Objective.reads``), with
    the kinds that read each: ``heads.build_head`` never sees them."""
    from draftsmith.train.objectives import objective_class

    names = {setting.removeprefix("head.") for kind in head_kinds() for setting in objective_class(kind).reads
             if setting.startswith("head.")}
    return {name: kinds_reading_setting(f"head.{name}") for name in sorted(names)}


def kinds_reading(name: str) -> tuple[str, ...]:
    """The head kinds that read ``head.<name>``: those whose head config takes it, or whose training objective
    does (``training_keys``)."""
    from draftsmith.heads.auto import HEAD_CLASSES, config_options

    read_by_objectives = training_keys()
    if name in read_by_objectives:
        return read_by_objectives[name]
    return tuple(kind for kind, cls in HEAD_CLASSES.items() if name in config_options(cls.config_class))


def _check_head(head: HeadConfig) -> None:
    """head.kind is registered and every head.* key set is read by that kind."""
    from draftsmith.heads.auto import HEAD_CLASSES

    if head.kind not in HEAD_CLASSES:
        raise ConfigError(f"head.kind: must be one of {', '.join(HEAD_CLASSES)} (got {head.kind!r})")
    for f in dataclasses.fields(head):
        kinds = kinds_reading(f.name) if f.name != "kind" else ()
        if f.name != "kind" and getattr(head, f.name) is not None and head.kind not in kinds:
            raise ConfigError(f"head.{f.name} applies only to head.kind={'/'.join(kinds)} (head.kind={head.kind}); "
                              f"set head.{f.name}=null or use a config file made for {head.kind} heads")


def _check_head_options(head: HeadConfig) -> None:
    """The kind's head config takes the options: its own checks, as ``heads.build_head`` runs them (the
    target is unknown here, so its vocabulary is taken as unbounded and its layers as unknown)."""
    from draftsmith.heads.auto import head_class

    options = head.build_options()
    try:
        head_class(head.kind, head.variant).config_class(**options, vocab_size=_UNBOUNDED_VOCAB)
    except ValueError as err:  # the parse-time placeholder vocabulary is not the user's: said as the target's
        text = str(err).replace(f"0..{_UNBOUNDED_VOCAB - 1}", "0..vocab_size-1 (the target's)").replace(
            f"vocab_size={_UNBOUNDED_VOCAB}", "the target's vocab_size")
        named = [name for name in options if name in text]
        if not named:
            raise ConfigError(f"head.kind={head.kind}: {text}") from None
        raise ConfigError(f"head.{text}" if text.startswith(named[0]) else f"head.{named[0]}: {text}") from None


_UNBOUNDED_VOCAB = 2**62  # parse time: no target yet, so no vocabulary bound on token-id options


# What the refusal of a setting only some kinds read adds to "applies only to head.kind=...": the way out
_INSTEAD = {"train.gamma": "; use train.loss_decay",
            "train.loss=dpace": ": its weights span the positions of one draft chain"}
# Settings some kinds declare (Objective.reads) that every kind's on-policy stage reads as well: its chains are
# rooted at the anchors they draw
_ALSO_READ_BY_THE_STAGE = ("train.anchors_per_document", "train.anchor_spacing")
# Settings read only under another setting's value: set without it, they would be ignored without a word
_READ_ONLY_WITH = {"train.dpace_alpha": "train.loss=dpace"}


def _is_set(cfg: TrainConfig, setting: str) -> bool:
    """``train.<key>``: set away from its default; ``train.<key>=<value>``: set to that value."""
    key, _, value = setting.partition("=")
    section, name = key.split(".")
    now = getattr(getattr(cfg, section), name)
    default = {f.name: f.default for f in dataclasses.fields(getattr(cfg, section))}[name]
    return str(now) == value if value else now != default


def _check_conditional_settings(cfg: TrainConfig) -> None:
    """A setting read only under another one's value (``_READ_ONLY_WITH``) is refused without it, from the
    command line and a config file alike (names no kind: no import, a mistake is one line in a second)."""
    for setting, condition in _READ_ONLY_WITH.items():
        if _is_set(cfg, setting) and not _is_set(cfg, condition):
            key, _, value = condition.partition("=")
            now = getattr(cfg.train, key.split(".")[1])
            raise ConfigError(f"{setting}={getattr(cfg.train, setting.split('.')[1])} is read only with {condition} "
                              f"({key}={now}); remove it or set {condition}")


def _check_kind_settings(cfg: TrainConfig) -> None:
    """Every ``train.*`` setting some kinds' objectives declare in ``Objective.reads`` (``train.<key>``: set
    away from its default; ``train.<key>=<value>``) is read by ``head.kind``'s objective (the anchors also by
    the on-policy stage of any kind that has one)."""
    from draftsmith.train.objectives import objective_class

    kind = cfg.head.kind
    declared = dict.fromkeys(setting for k in head_kinds() for setting in objective_class(k).reads
                             if not setting.startswith("head."))
    for setting in declared:
        if not _is_set(cfg, setting) or setting in objective_class(kind).reads:
            continue
        if setting in _ALSO_READ_BY_THE_STAGE and cfg.train.stage == "on-policy":
            continue
        also = " or train.stage=on-policy" if setting in _ALSO_READ_BY_THE_STAGE else ""
        raise ConfigError(f"{setting} applies only to head.kind={'/'.join(kinds_reading_setting(setting))}{also} "
                          f"(head.kind={kind}, train.stage={cfg.train.stage}){_INSTEAD.get(setting, '')}")


def _validate(cfg: TrainConfig) -> None:
    """Check ranges and combinations; fill the output_dir and, through the kind's objective
    (``Objective.configure``), its defaults (``head.ttt_steps``, ``train.feature_noise``)."""
    head, data, opt = cfg.head, cfg.data, cfg.train

    positive = {
        "head.draft_vocab_size": head.draft_vocab_size, "head.ttt_steps": head.ttt_steps,
        "head.num_heads": head.num_heads, "head.num_layers": head.num_layers,
        "head.intermediate_size": head.intermediate_size, "head.block_size": head.block_size,
        "head.exit_layer": head.exit_layer,
        "data.max_length": data.max_length,
        "data.eval_rows": data.eval_rows, "train.max_steps": opt.max_steps, "train.epochs": opt.epochs,
        "train.micro_batch_size": opt.micro_batch_size, "train.grad_accum_steps": opt.grad_accum_steps,
        "train.keep_last_checkpoints": opt.keep_last_checkpoints, "train.log_every": opt.log_every,
        "train.eval_depth": opt.eval_depth, "data.self_distill.max_new_tokens": data.self_distill.max_new_tokens,
        "data.self_distill.prompt_tokens": data.self_distill.prompt_tokens,
        "data.self_distill.batch_size": data.self_distill.batch_size,
    }
    non_negative = {
        "train.warmup_steps": opt.warmup_steps, "train.eval_every": opt.eval_every,
        "train.save_every": opt.save_every, "train.weight_decay": opt.weight_decay,
        "train.feature_noise": opt.feature_noise, "data.self_distill.rows": data.self_distill.rows,
    }
    for values, least in ((positive, 1), (non_negative, 0)):
        for key, value in values.items():
            if value is not None and value < least:
                raise ConfigError(f"{key} must be >= {least}, got {value}")
    _validate_recipe(cfg)
    _validate_backbone(cfg)
    _check_conditional_settings(cfg)
    if data.features is not None and data.feature_cache is not None:
        raise ConfigError("data.features (stored features) and data.feature_cache (filled while training) exclude "
                          "each other: set one of them to null")
    for key, value in (("data.features", data.features), ("data.feature_cache", data.feature_cache)):
        if value is not None and not value.strip():
            raise ConfigError(f"{key} must be a folder path or null, got {value!r}")
    if data.self_distill.rows and opt.target_sharding == "fsdp":
        raise ConfigError("data.self_distill.rows with train.target_sharding=fsdp: one process cannot generate with a "
                          "sharded target; regenerate first (scripts/regenerate.py --engine openai) and train on the file")
    if data.feature_cache is not None and opt.target_sharding == "fsdp":
        raise ConfigError("data.feature_cache with train.target_sharding=fsdp: processes reading the cache would skip "
                          "the sharded target's collective forward while others run it; use data.features (a dump)")
    _check_eval_temperature(opt)
    temperatures("data.self_distill.temperature", data.self_distill.temperature)  # kept as given: a float stays one
    if not opt.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {opt.lr}")
    if opt.max_minutes is not None and not opt.max_minutes > 0:
        raise ConfigError(f"train.max_minutes must be > 0 or null, got {opt.max_minutes}")
    if not all(0 <= b < 1 for b in opt.betas):
        raise ConfigError(f"train.betas must lie in [0, 1), got {list(opt.betas)}")
    if not opt.max_grad_norm > 0:
        raise ConfigError(f"train.max_grad_norm must be > 0, got {opt.max_grad_norm}")
    if not 0 < opt.loss_decay <= 1:
        raise ConfigError(f"train.loss_decay must lie in (0, 1], got {opt.loss_decay}")
    if not cfg.target:
        raise ConfigError("target must be a path, a hub id or demo:<size>")
    if cfg.resume_from is not None and not cfg.resume_from:
        raise ConfigError("resume_from must be null, 'latest' or a checkpoint path")
    # The head checks load the head classes (torch, transformers: 15-26 s on a busy machine), so they
    # come after every check that needs none: a mistake in a number is one line in a second.
    _check_head(head)
    _check_kind_settings(cfg)
    _check_head_options(head)
    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir(cfg)
    from draftsmith.train.objectives import objective_class  # torch: after the checks that need none

    objective_class(head.kind, head.variant).configure(cfg)  # last: it may rely on every check above


def temperatures(key: str, value: float | list[float]) -> list[float]:
    """``value`` (one temperature or a list) as a list of distinct temperatures >= 0; a ConfigError naming ``key``
    otherwise."""
    temps = value if isinstance(value, list) else [value]
    if not temps:
        raise ConfigError(f"{key}: give at least one temperature (0 = greedy), e.g. [0, 1]")
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise ConfigError(f"{key}: {t!r} is no temperature (a number >= 0; 0 = greedy)")
    if len(set(temps)) < len(temps):
        raise ConfigError(f"{key}: {temps} lists a temperature twice")
    return [float(t) for t in temps]


def _check_eval_temperature(opt) -> None:
    """``train.eval_temperature`` made a list of distinct temperatures >= 0; ``train.best_by`` one of the
    records' keys it allows."""
    opt.eval_temperature = temperatures("train.eval_temperature", opt.eval_temperature)
    allowed = ["auto", "simulated_tau", *(decode_tau_key(t) for t in opt.eval_temperature)]
    if opt.best_by not in allowed:
        raise ConfigError(f"train.best_by: {opt.best_by!r} is none of {', '.join(allowed)} (decode_tau_<T> needs T "
                          "in train.eval_temperature)")


def _validate_recipe(cfg: TrainConfig) -> None:
    """The DFlash recipe's keys, D-PACE and the on-policy stage: their ranges and combinations (which kinds
    read them: ``_check_kind_settings``)."""
    opt = cfg.train
    if opt.gamma is not None and not opt.gamma > 0:
        raise ConfigError(f"train.gamma must be > 0, got {opt.gamma}")
    if not 0 < opt.dpace_alpha <= 1:
        raise ConfigError(f"train.dpace_alpha must lie in (0, 1], got {opt.dpace_alpha}")
    for key in ("anchors_per_document", "anchor_spacing"):
        if getattr(opt, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(opt, key)}")
    if opt.stage == "on-policy":
        if opt.init_from is None and cfg.resume_from is None:
            raise ConfigError("train.stage=on-policy continues a trained head: set train.init_from to its directory")
        if opt.loss != "ce":
            raise ConfigError(f"train.stage=on-policy has its own loss (forward KL where the target accepted, decayed "
                              f"reverse KL where it rejected); train.loss={opt.loss} must be ce")


def _validate_backbone(cfg: TrainConfig) -> None:
    """Medusa-2's keys: the LoRA rank, its lr and the heads' loss weight in range (which kinds read them:
    ``_check_kind_settings``; their combinations: the objective's ``configure``)."""
    opt = cfg.train
    if opt.backbone_lora_rank < 0:
        raise ConfigError(f"train.backbone_lora_rank must be >= 0, got {opt.backbone_lora_rank}")
    if opt.backbone_lr is not None and not opt.backbone_lora_rank:
        raise ConfigError("train.backbone_lr needs train.backbone_lora_rank >= 1 (no backbone is trained)")
    if opt.backbone_lr is not None and not opt.backbone_lr > 0:
        raise ConfigError(f"train.backbone_lr must be > 0, got {opt.backbone_lr}")
    if not opt.heads_coefficient > 0:
        raise ConfigError(f"train.heads_coefficient must be > 0, got {opt.heads_coefficient}")


def default_output_dir(cfg: TrainConfig) -> str:
    """``runs/<target slug>-<head kind>``: where a run writes when ``output_dir`` is null."""
    return str(Path("runs") / f"{target_slug(cfg.target)}-{cfg.head.kind}")


def target_slug(target: str) -> str:
    """A short file-name-safe name for a target (``meta-llama/Llama-3.1-8B`` -> ``Llama-3.1-8B``)."""
    name = target.replace(":", "-").rstrip("/").split("/")[-1]
    return re.sub(r"[^\w.-]+", "-", name) or "target"


def help_text(cfg: TrainConfig | None = None) -> str:
    """Every key with its value in ``cfg`` (the effective default: the default config file plus the
    dataclass defaults it leaves) or, without ``cfg``, the dataclass default; and its description."""
    lines = []

    def walk(cls: type, node: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], getattr(node, f.name) if node is not None else None, f"{prefix}{f.name}.")
                continue
            if node is not None:
                value = getattr(node, f.name)
            else:
                value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = yaml.safe_dump(plain(value), default_flow_style=True).removesuffix("...\n").strip()
            lines.append(f"  {prefix}{f.name} = {shown}")
            text = f.metadata.get("help", "")
            if cls is HeadConfig and f.name == "kind":
                text += f": {' | '.join(HEAD_KINDS)}"
            lines.append(f"      {text}")

    walk(TrainConfig, cfg, "")
    return "\n".join(lines)
