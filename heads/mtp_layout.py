"""Where a family's checkpoint keeps its MTP layers: the one table the MTP export, the stitch into a target's
folder and the Hub download read (docs/mtp.md). A new family is one entry of ``MTP_LAYOUTS``; how each of its
names maps onto the head is ``heads.mtp_native``'s."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MtpLayout:
    """One checkpoint layout of MTP layers.

    prefixes: (trunk layers L, MTP layers n) -> the name prefixes every MTP tensor of the checkpoint starts with.
    carried: copies of the target's own tensors each MTP layer holds in the published checkpoints, as
        (name under each prefix, ``embedding`` or ``lm_head``); an export writes them, the head holds none.
    count_key: the config key declaring how many MTP layers the checkpoint has.
    """

    prefixes: Callable[[int, int], list[str]]
    carried: tuple[tuple[str, str], ...]
    count_key: str


MTP_LAYOUTS: dict[str, MtpLayout] = {
    # DeepSeek-V3's index: model.layers.61.{embed_tokens, shared_head.head}.weight beside the layer's own tensors
    "deepseek": MtpLayout(lambda layers, n: [f"model.layers.{layers + i}." for i in range(n)],
                          (("embed_tokens.weight", "embedding"), ("shared_head.head.weight", "lm_head")),
                          "num_nextn_predict_layers"),
    # Qwen3-Next's index: mtp.* only (embedding and lm_head are the trunk's)
    "qwen3_next": MtpLayout(lambda layers, n: ["mtp."], (), "mtp_num_hidden_layers"),
}


def mtp_layout(style: str) -> MtpLayout:
    if style not in MTP_LAYOUTS:
        raise ValueError(f"MTP layout {style!r} is not one of {sorted(MTP_LAYOUTS)}")
    return MTP_LAYOUTS[style]


def is_mtp_name(style: str, layers: int, n: int, name: str) -> bool:
    """Whether checkpoint tensor ``name`` belongs to the MTP layers (carried copies included)."""
    return name.startswith(tuple(mtp_layout(style).prefixes(layers, n)))


def carried_names(style: str, layers: int, n: int) -> dict[str, str]:
    """Checkpoint name -> ``embedding`` / ``lm_head``: the target tensors the layout's MTP layers carry."""
    layout = mtp_layout(style)
    return {prefix + name: which for prefix in layout.prefixes(layers, n) for name, which in layout.carried}
