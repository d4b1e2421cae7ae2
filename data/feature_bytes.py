"""Disk size of offline target features: what a feature dump of a data set occupies.

A pure function, shared by the cost planner (``train.plan``) and any feature dump, so both agree on
what is stored: per token, the ``aux_layers`` captured hidden states plus one more hidden-size vector
(the final hidden state, or the input embedding, depending on the head kind), each ``hidden_size``
values of ``dtype``. Token ids, loss masks and file headers are small next to them and not counted.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def feature_disk_bytes(rows: int, tokens_per_row: float, aux_layers: int, hidden_size: int,
                       dtype: str = "bfloat16") -> int:
    """rows × tokens_per_row × (aux_layers + 1) × hidden_size × bytes per ``dtype`` value."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"feature dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    for name, value in (("rows", rows), ("tokens_per_row", tokens_per_row), ("aux_layers", aux_layers),
                        ("hidden_size", hidden_size)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return int(rows * tokens_per_row * (aux_layers + 1) * hidden_size * DTYPE_BYTES[dtype])
