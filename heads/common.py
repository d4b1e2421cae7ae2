"""What every draft head shares: the target's identity, and the check that a head fits a target."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init

from draftsmith.data.base.checks import indices
from draftsmith.data.base.names import ADAPTER_BASE_KEY
from draftsmith.data.base.paths import share_readable
from draftsmith.heads.layers import RMSNorm

# Fields that decide whether a head's tensors fit a target. Checked on every use.
_SHAPE_FIELDS = ("hidden_size", "num_layers", "vocab_size")


def text_config(target: PretrainedConfig | PreTrainedModel) -> PretrainedConfig:
    """The decoder's config of a target model or config (multimodal configs nest it)."""
    config = target.config if isinstance(target, PreTrainedModel) else target
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"expected a transformers model or config, got {type(target).__name__}")
    return config.get_text_config()


def target_identity(target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
    """The facts about a target that a head records and checks (no weights)."""
    config = text_config(target)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if getattr(config, k, None) is None]
    if missing:
        raise ValueError(f"target config {type(config).__name__} has no {', '.join(missing)}")
    architectures = getattr(config, "architectures", None) or [type(target).__name__]
    return {
        "name_or_path": getattr(config, "_name_or_path", "") or "",
        "architecture": architectures[0],
        "model_type": getattr(config, "model_type", "") or "",
        "hidden_size": int(config.hidden_size),
        "num_layers": int(config.num_hidden_layers),
        "vocab_size": int(config.vocab_size),
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0),
        # a PEFT adapter target (merged by data.targets.load_target): name_or_path is the adapter, this its base
        "base_name_or_path": getattr(config, ADAPTER_BASE_KEY, "") or "",
    }


def rope_config_from_target(target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
    """The target's RoPE settings as one flat dict: ``rope_type``, ``rope_theta`` and scaling fields.

    transformers 5 keeps them in ``rope_parameters``; older configs in ``rope_theta``/``rope_scaling``.
    """
    config = text_config(target)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # Per-layer-type parameters (e.g. {"full_attention": {...}, "sliding_attention": {...}}).
        params = params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and params:
        rope = dict(params)
    else:
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    # Qwen3.5 / Qwen3-Next rotate a quarter of each attention head: a fact of the target's attention, not of
    # the frequencies; a head's own Llama layer rotates its whole head_dim (heads.layers.Rotary), as the
    # engines' EAGLE-3 layers do, and an export carrying the key was refused.
    rope.pop("partial_rotary_factor", None)
    if rope["rope_type"] == "proportional":  # LFM3's: the default frequencies (over ``factor``) on the rotated
        # part of a head; over a whole head (the partial factor dropped above) that is the linear rope
        rope["rope_type"] = "linear"
        rope["factor"] = float(rope.get("factor", 1.0))
    return rope


# Where transformers' decoder stacks keep their final norm: most at ``norm``; LFM2 ``embedding_norm``,
# Nemotron-H ``norm_f``, Falcon-H1 / Bamba / Jamba ``final_layernorm``.
FINAL_NORM_NAMES = ("norm", "embedding_norm", "norm_f", "final_layernorm")


def final_norm_name(backbone: nn.Module | None) -> str | None:
    """The attribute of ``backbone`` holding its final norm, or None when it has none of the known names."""
    return next((n for n in FINAL_NORM_NAMES if isinstance(getattr(backbone, n, None), nn.Module)), None)


def final_norm_scale(target: nn.Module, width: int, otherwise: str) -> Tensor:
    """The per-channel scale (H,) of the target's final norm, read by probing it (so Gemma's ``1 + w``
    and plain RMSNorm read alike): an RMS norm maps sqrt(H)·e_i (RMS 1) to sqrt(H)·w_i·e_i. A head
    starting from it says in ``otherwise`` what to do when the target has no such norm."""
    backbone = getattr(target, getattr(target, "base_model_prefix", ""), None)
    name = final_norm_name(backbone)
    final_norm = getattr(backbone, name, None) if name else None
    if not isinstance(final_norm, nn.Module):
        raise ValueError(f"{type(target).__name__} has no final norm at `<backbone>.norm` to start the head from; "
                         + otherwise)
    like = next(final_norm.parameters(), None)
    if like is None:  # a norm without a learned scale
        like = target.get_output_embeddings().weight
    probe = torch.eye(width, device=like.device, dtype=like.dtype) * math.sqrt(width)
    out = final_norm(probe).float() / math.sqrt(width)  # (H, H): diag(w) for an RMS norm
    scale = out.diagonal()
    if out.shape != (width, width) or (out - torch.diag(scale)).abs().max() > 1e-3 * max(1.0, scale.abs().max()):
        raise ValueError(f"the final norm of {type(target).__name__} ({type(final_norm).__name__}) is not an RMS norm "
                         "of the head's width; " + otherwise)
    return scale


def check_variant(config_cls: type, variant: str | None, variants: tuple[str, ...]) -> str:
    """The variant a config of ``config_cls`` is: ``variant`` (None: the class's own ``variant``), refused
    (ValueError, one line) when it is none of the kind's ``variants``, or one another class builds (a variant
    with a class of its own, ``heads.variants``: ``heads.auto.head_class`` finds it)."""
    variant = config_cls.variant if variant is None else variant
    if variant not in variants:
        raise ValueError(f"variant={variant!r} must be one of {', '.join(variants)}")
    if variant not in (config_cls.variant, *vars(config_cls).get("inline_variants", ())):
        raise ValueError(f"variant={variant} is built by its own class, not {config_cls.__name__}: use "
                         "heads.build_head or heads.auto.head_class")
    return variant


def refuse_variant_options(variant: str, given: dict[str, Any], owners: dict[str, str]) -> None:
    """Refuse (ValueError, one line) an option set (not None) that only another variant of the kind takes."""
    extra = [k for k, v in given.items() if v is not None and owners[k] != variant]
    if extra:
        raise ValueError(f"{extra[0]}={given[extra[0]]} applies only to variant={owners[extra[0]]} "
                         f"(variant={variant})")


class DraftHeadConfig(PretrainedConfig):
    """Base config of all heads: the target's identity travels with the weights.

    Args:
        target_name_or_path: hub id or path of the target the head was made for.
        target_architecture: e.g. ``"LlamaForCausalLM"``.
        target_model_type: e.g. ``"llama"``.
        target_hidden_size, target_num_layers, target_vocab_size: checked on every use.
        target_max_position_embeddings: the target's context length.
        target_base_name_or_path: the model the target derives from: a PEFT adapter's base (the
            adapter is ``target_name_or_path``), or a Medusa-2 run's original target; empty otherwise.
    """

    head_kind: str = ""

    def __init__(
        self,
        target_name_or_path: str = "",
        target_architecture: str = "",
        target_model_type: str = "",
        target_hidden_size: int = 0,
        target_num_layers: int = 0,
        target_vocab_size: int = 0,
        target_max_position_embeddings: int = 0,
        target_base_name_or_path: str = "",
        **kwargs,
    ):
        self.target_name_or_path = target_name_or_path
        self.target_architecture = target_architecture
        self.target_model_type = target_model_type
        self.target_hidden_size = target_hidden_size
        self.target_num_layers = target_num_layers
        self.target_vocab_size = target_vocab_size
        self.target_max_position_embeddings = target_max_position_embeddings
        self.target_base_name_or_path = target_base_name_or_path
        super().__init__(**kwargs)

    @classmethod
    def identity_kwargs(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        """``target_*`` constructor arguments describing ``target``."""
        return {f"target_{k}": v for k, v in target_identity(target).items()}


class DraftHead(PreTrainedModel):
    """Behaviour shared by all heads. Subclasses set ``config_class`` and build their modules."""

    config_class = DraftHeadConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = False
    title = ""  # the kind's name on its model card ("EAGLE-3")
    reads_formats: tuple[str, ...] = ()  # export formats draftsmith loads back as this kind (heads.formats)

    def card_input_lines(self, export_config: dict | None) -> list[str]:
        """A model card's "What the head reads": markdown bullets (``export_config``: the config.json an
        export writes, or None for draftsmith's own format)."""
        raise NotImplementedError(f"{type(self).__name__} has no card text: define card_input_lines")

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        """A model card's engine usage in markdown: ``served`` is the target an engine loads, ``serve_dir``
        the head's export, ``export_step(fmt)`` the export command's lines (empty when the card is an
        export's), ``fmt`` the card's export format or None. A kind no engine serves returns none."""
        return []

    def _init_weights(self, module: nn.Module) -> None:
        """The EAGLE heads' init (Medusa overrides it): normal linears with zero biases, unit norms."""
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)

    @classmethod
    def from_pretrained(cls, path_or_repo, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, refusing a head whose weights file lacks a tensor or
        holds one the config does not declare (transformers would fill the gap with random weights
        behind a warning table)."""
        wants_info = kwargs.pop("output_loading_info", False)
        local = Path(str(path_or_repo)).expanduser()
        if local.is_dir() and not list(local.glob("*.safetensors")) and list(local.glob("*.bin")):
            raise ValueError(f"{path_or_repo}: holds only pickled weights ({', '.join(p.name for p in local.glob('*.bin'))}); "
                             "draftsmith heads load from safetensors only (no pickle is ever unpickled)")
        kwargs.setdefault("use_safetensors", True)
        if "config" not in kwargs:  # read first, so that a value the config refuses names the file
            hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only", "force_download",
                                          "subfolder") if k in kwargs}
            try:
                kwargs["config"] = cls.config_class.from_pretrained(path_or_repo, **hub)
            except ValueError as err:
                raise ValueError(f"{path_or_repo}/config.json: {err}") from None
        try:
            head, info = super().from_pretrained(path_or_repo, *args, output_loading_info=True, **kwargs)
        except ValueError as err:  # a value the head itself refuses (e.g. early-exit's exit_layer): name the folder
            if str(path_or_repo) in str(err):
                raise
            raise ValueError(f"{path_or_repo}: {err}") from None
        problems = {what: sorted(info.get(key) or ()) for what, key in
                    (("missing", "missing_keys"), ("not declared by its config", "unexpected_keys"),
                     ("of another shape", "mismatched_keys"))}
        problems = {what: names for what, names in problems.items() if names}
        if problems:
            listed = "; ".join(f"{what}: {', '.join(map(str, names[:6]))}{' ...' if len(names) > 6 else ''}"
                               for what, names in problems.items())
            raise ValueError(f"{path_or_repo}: the head's weights do not match its config.json ({listed}); "
                             "the checkpoint is incomplete or was edited: save or download it again")
        head.check_indices(path_or_repo)
        return (head, info) if wants_info else head

    def check_indices(self, where: object = "") -> None:
        """The numbers this head's files carry and use as indices, checked against the target they
        index (``target_*`` of its config) when it is loaded: one line naming ``where``, the field and
        the allowed range. Here the feature layers (the config checks each kind's own rule); kinds
        with index tensors (EAGLE-3's d2t/t2d) add theirs."""
        layers = self.config.target_num_layers
        if layers:
            indices("feature_layer_ids", list(self.feature_layer_ids), layers, where,
                    f"hidden_states entering the target's {layers} layers")

    @classmethod
    def config_from_target(cls, target: PretrainedConfig | PreTrainedModel) -> dict[str, Any]:
        """Config fields a fresh head of this kind takes from ``target`` (its identity, at least)."""
        return cls.config_class.identity_kwargs(target)

    def init_from_target_model(self, target: PreTrainedModel) -> None:
        """What a fresh head copies from a loaded target at build time (nothing by default)."""

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """``PreTrainedModel.save_pretrained``, then files readable by other users (``share_readable``)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        share_readable(save_directory)
        return result

    @property
    def head_kind(self) -> str:
        return self.config.head_kind

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        """HF hidden_states indices the head reads; () = the target's final post-norm state."""
        return ()

    def check_target(self, target: PretrainedConfig | PreTrainedModel) -> None:
        """Raise ``ValueError`` naming every field where ``target`` does not fit this head.

        Fields the head does not know (0: e.g. a public checkpoint imported without its target)
        are not compared; the feature layers a head reads must exist in the target.
        """
        have = target_identity(target)
        problems = []
        for field in _SHAPE_FIELDS:
            want = getattr(self.config, f"target_{field}")
            if want and want != have[field]:
                problems.append(f"{field}={want} (head) vs {field}={have[field]} (target)")
        missing = [i for i in self.feature_layer_ids if not 0 <= i < have["num_layers"]]
        if missing:
            problems.append(f"feature layers {missing} (head) vs num_layers={have['num_layers']} (target)")
        if problems:
            raise ValueError(
                f"this {self.head_kind} head was made for target "
                f"'{self.config.target_name_or_path or self.config.target_architecture}', which does not "
                f"match the given target '{have['name_or_path'] or have['architecture']}': " + "; ".join(problems)
            )

    def push_to_hub(self, *args, **kwargs):
        """Refused: transformers' upload would replace the head's model card with a generic one.
        Publish with ``heads.hub.push_head_to_hub`` or ``scripts/push_to_hub.py``."""
        raise NotImplementedError("a draft head is published with heads.hub.push_head_to_hub (or "
                                  "scripts/push_to_hub.py), which writes its model card")
