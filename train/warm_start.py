"""``train.init_from``: start a run's head from a head trained earlier (e.g. on the base model of a
target that is now a PEFT adapter on it) instead of from scratch."""
from __future__ import annotations

from torch import nn

from draftsmith.data.targets import check_head_source

# Config keys a warm start may change: which target the head is for, and what saving records.
_FREE_KEYS = {"target_name_or_path", "target_base_name_or_path", "target_architecture", "target_model_type",
              "target_max_position_embeddings", "_name_or_path", "transformers_version", "architectures", "dtype",
              "torch_dtype"}


def warm_start(head: nn.Module, source: str) -> None:
    """Copy the weights of the head saved at ``source`` into ``head`` (a fresh head of this run).

    Both must be the same kind with the same shape (every config key but the target's name and the
    saving records; target hidden size, layers and vocabulary included); otherwise ``ValueError``
    names the keys and both values."""
    from draftsmith.heads import AutoHead

    check_head_source(source)
    trained = AutoHead.from_pretrained(source)
    if trained.head_kind != head.head_kind:
        raise ValueError(f"train.init_from={source}: a {trained.head_kind} head; this run trains "
                         f"head.kind={head.head_kind}")
    ours, theirs = head.config.to_dict(), trained.config.to_dict()
    diff = [f"{k}: {theirs.get(k)!r} (init_from) vs {ours.get(k)!r} (this run)"
            for k in sorted((set(ours) | set(theirs)) - _FREE_KEYS) if ours.get(k) != theirs.get(k)]
    if diff:
        raise ValueError(f"train.init_from={source}: the head does not fit this run's: " + "; ".join(diff))
    head.load_state_dict(trained.state_dict(), strict=True)
