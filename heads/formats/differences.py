"""What differs between an export on disk and what a head exports in that format now (``draftsmith
check-export``): every config key but the recorded target facts, and every tensor."""
from __future__ import annotations

import json
from pathlib import Path


def export_differences(head, export: Path, fmt: str, target) -> list[str]:
    """What differs between the export at ``export`` (format ``fmt``) and what ``head`` exports in that format
    now: every config key but the recorded target facts (``target``, a model or its config, fills them) and
    every tensor, compared in the export's own dtype. What the user chose at export (the dtype, the context, a
    speculators export's proposal length and verifier) is read from the export; a target model (not only its
    config) gives the embedding a speculators EAGLE-3 export carries. One line per difference; none when it
    is this head's."""
    import torch

    from draftsmith.heads.formats import FORMATS, _target_facts, _target_weights
    from draftsmith.heads.formats.validation import PROVENANCE_KEY, read_json_object, read_tensors

    config = read_json_object(export / "config.json")
    tensors = read_tensors(export / FORMATS[fmt].weights_file)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    layer = config.get("transformer_layer_config") if isinstance(config.get("transformer_layer_config"), dict) else {}
    context = config.get("max_position_embeddings", layer.get("max_position_embeddings"))
    spec = config.get("speculators_config") if isinstance(config.get("speculators_config"), dict) else {}
    methods = spec.get("proposal_methods")
    proposal = methods[0] if isinstance(methods, list) and methods else {}
    tokens = proposal.get("speculative_tokens") if isinstance(proposal, dict) else None
    options = {"dtype": dtypes.pop() if len(dtypes) == 1 else None,
               "num_speculative_tokens": tokens if isinstance(tokens, int) and tokens >= 1 else 3,
               "max_position_embeddings": context if isinstance(context, int) else head.config.max_position_embeddings,
               **_target_weights(target)}
    facts = _target_facts(head, target)
    verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec.get("verifier"), dict) else None
    if fmt == "speculators" and isinstance(verifier, str) and verifier:
        facts["name_or_path"] = verifier  # written as the user gave it (--verifier)
    try:
        artifact = FORMATS[fmt].build(head, facts, options)
    except ValueError as err:
        return [f"--head cannot be exported as '{fmt}': {err}"]
    ours, theirs = _flat(artifact.config), _flat(config)
    skip = f"{PROVENANCE_KEY}.target."
    lines = [f"config {key}: export {theirs.get(key, '(absent)')!r}, --head writes {ours.get(key, '(absent)')!r}"
             for key in sorted(ours.keys() | theirs.keys())
             if not key.startswith(skip) and _plain(ours.get(key)) != _plain(theirs.get(key))]
    for name in sorted(artifact.tensors.keys() | tensors.keys()):
        mine, other = artifact.tensors.get(name), tensors.get(name)
        if mine is None or other is None:
            lines.append(f"tensor {name}: only in {'the export' if mine is None else '--head'}")
        elif mine.shape != other.shape or not torch.equal(mine.to(other.dtype), other):
            lines.append(f"tensor {name}: differs from --head's" + (
                f" (shape {tuple(other.shape)}, --head {tuple(mine.shape)})" if mine.shape != other.shape else ""))
    return lines


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    out = {}
    for key, value in config.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _plain(value):
    """A config value as JSON reads it back (tuples as lists)."""
    return json.loads(json.dumps(value))
