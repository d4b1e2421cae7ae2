"""Serving-engine formats: export a head for vLLM, SGLang, TensorRT-LLM and TGI; import public EAGLE-3.

| format          | head   | weights file               | loads in                                          |
|-----------------|--------|----------------------------|---------------------------------------------------|
| `vllm`/`sglang` | eagle3 | model.safetensors          | vLLM eagle3, SGLang EAGLE3, TensorRT-LLM Eagle3   |
| `speculators`   | eagle3 | model.safetensors          | vLLM alone (`vllm serve DIR`), speculators lib;   |
|                 |        | (layer named `layers.0.*`) | not SGLang                                        |
|                 | dflash | model.safetensors          | vLLM alone (`speculators_model_type: dflash`)     |
| `eagle-vllm`    | eagle  | model.safetensors          | vLLM eagle                                        |
| `medusa-vllm`   | medusa | model.safetensors          | vLLM medusa                                       |
| `medusa-tgi`    | medusa | medusa_lm_head.safetensors | TGI, TensorRT-LLM's Medusa converter              |
| `dflash`        | dflash | model.safetensors          | SGLang DFLASH, z-lab's `DFlashDraftModel`         |
|                 | (dflash2, domino variants)          | (DFlash2: z-lab's; Domino: SpecForge's)           |
| `dspark`        | dflash | model.safetensors          | SGLang DSPARK, DeepSpec's `Qwen3DSparkModel`      |
|                 | (dspark variant)                    |                                                   |
| `mtp`           | mtp    | model.safetensors          | the target's own checkpoint, after `draftsmith    |
|                 |        | (the family's own names)   | stitch` (vLLM / SGLang MTP, transformers)         |

`vllm` and `sglang` name the same directory: one export serves all three EAGLE-3 engines.

EAGLE-3 aux-layer ids come in two conventions. draftsmith, HF `output_hidden_states` and vLLM's
top-level `eagle_aux_hidden_state_layer_ids` index the residual stream *entering* layer k (0 =
embeddings). SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` and TensorRT-LLM's
`eagle3_layers_to_capture` count the *output* of layer k, i.e. k + 1 in HF terms.

Engines skip misnamed tensors silently (acceptance ≈ 1), so every export is checked in memory, written
to a temporary directory, read back and checked again (key set, shapes, dtypes, values, d2t
invariants, config fields) before it is moved into place. README.md ("Serve with vLLM / SGLang /
TensorRT-LLM") lists the engine loader code each format was checked against.

One module per engine family: ``eagle3`` (vLLM / SGLang / TensorRT-LLM), ``speculators``, ``eagle``
(vLLM EAGLE-1/2), ``medusa`` (vLLM and TGI), ``dflash`` (z-lab's layout, exported and imported),
``public`` (importing public EAGLE-3 checkpoints), ``mtp`` (a target's own MTP layers, its family's names), all on
the shared checks in ``validation``. This module holds the registry (``FORMATS``: one ``Format`` record
each) and the export driver.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedModel

from draftsmith.data.base.checks import count
from draftsmith.data.base.names import is_head_model_type, public_target_name
from draftsmith.data.base.paths import share_readable
from draftsmith.heads.card import model_card
from draftsmith.heads.common import DraftHead, target_identity
from draftsmith.heads.formats.dflash import DFLASH_ARCHITECTURE, _dflash_artifact, _dflash_problems, import_dflash
from draftsmith.heads.formats.variants.dspark import _dspark_artifact, _dspark_problems, import_dspark
from draftsmith.heads.formats.eagle import _eagle_artifact, _eagle_problems
from draftsmith.heads.formats.eagle3 import (_eagle3_artifact, _eagle3_problems, _sglang_eagle3_artifact,
                                            aux_layer_ids_from_config, draft_vocab_problems)
from draftsmith.heads.formats.mtp import MTP_ARCHITECTURE, _mtp_artifact, _mtp_problems, import_mtp
from draftsmith.heads.formats.medusa import _medusa_tgi_artifact, _medusa_tgi_problems, _medusa_vllm_artifact, _medusa_vllm_problems
from draftsmith.heads.formats.parity import checked_section
from draftsmith.heads.formats.public import import_eagle3
from draftsmith.heads.formats.speculators import (SPECULATORS_LAYER_PREFIX, _speculators_artifact, import_speculators_dflash,
                                      speculators_problems)
from draftsmith.heads.formats.validation import (
    EAGLE3_ARCHITECTURE,
    ENGINE_AUX_LAYERS,
    FORMAT_VERSION,
    HF_CONVENTION,
    PROVENANCE_KEY,
    Artifact,
    raise_problems,
    read_json_object,
    read_tensors,
    _TARGET_FIELDS,
)

__all__ = [
    "EAGLE3_ARCHITECTURE", "ENGINE_AUX_LAYERS", "FORMATS", "FORMAT_VERSION", "Format", "HF_CONVENTION",
    "PROVENANCE_KEY", "SPECULATORS_LAYER_PREFIX", "Artifact", "aux_layer_ids_from_config", "draft_vocab_problems",
    "export_head", "import_eagle3", "validate_artifact", "validate_export", "DFLASH_ARCHITECTURE", "import_dflash",
    "import_speculators_dflash", "import_dspark", "needs_target_weights", "MTP_ARCHITECTURE", "import_mtp",
]


@dataclass(frozen=True)
class Format:
    """One serving format: the head kinds it exports, how an export is built (head, target facts,
    options -> ``Artifact``), how a config + tensors pair is checked (-> problems) and its weights file."""

    kinds: tuple[str, ...]
    build: Callable[[DraftHead, dict[str, Any], dict[str, Any]], Artifact]
    problems: Callable[[dict[str, Any], dict[str, Tensor]], list[str]]
    weights_file: str = "model.safetensors"
    target_weights: tuple[str, ...] = ()  # the head kinds whose export carries target tensors (needs the model)


def _flat_eagle3_problems(config: dict[str, Any], tensors: dict[str, Tensor]) -> list[str]:
    return _eagle3_problems(config, config, tensors)


FORMATS: dict[str, Format] = {
    "vllm": Format(("eagle3",), _eagle3_artifact, _flat_eagle3_problems),
    "sglang": Format(("eagle3",), _sglang_eagle3_artifact, _flat_eagle3_problems),
    "speculators": Format(("eagle3", "dflash"), _speculators_artifact, speculators_problems,
                          target_weights=("eagle3",)),  # EAGLE-3: the target's embed_tokens
    "eagle-vllm": Format(("eagle",), _eagle_artifact, _eagle_problems),
    "medusa-vllm": Format(("medusa",), _medusa_vllm_artifact, _medusa_vllm_problems),
    "medusa-tgi": Format(("medusa",), _medusa_tgi_artifact, _medusa_tgi_problems, "medusa_lm_head.safetensors"),
    "dflash": Format(("dflash",), _dflash_artifact, _dflash_problems),
    "dspark": Format(("dflash",), _dspark_artifact, _dspark_problems,  # DSpark heads (head.variant=dspark) only
                     target_weights=("dflash",)),  # the target's embed_tokens and lm_head
    "mtp": Format(("mtp",), _mtp_artifact, _mtp_problems, target_weights=("mtp",)),  # DeepSeek's carry embed/lm_head
}


def needs_target_weights(head: DraftHead, fmt: str) -> bool:
    """Whether exporting ``head`` as ``fmt`` copies target tensors (``target=`` must be the model, not its config)."""
    return head.head_kind in _format(fmt).target_weights


EXPORT_MARKER = ".draftsmith-export"  # written first into every export: --overwrite may replace only such a folder


def export_head(
    head: DraftHead,
    out_dir: str | Path,
    fmt: str,
    *,
    target: PretrainedConfig | PreTrainedModel | None = None,
    dtype: torch.dtype | None = None,
    num_speculative_tokens: int = 3,
    max_position_embeddings: int | None = None,
    overwrite: bool = False,
    verifier: str | None = None,
) -> Path:
    """Write ``head`` in serving format ``fmt`` (see ``FORMATS``) to ``out_dir``, with a model card.

    ``target`` (optional) is checked against the head and fills in target facts the head lacks.
    ``dtype`` casts the floating-point weights (default: as they are). ``max_position_embeddings``
    defaults to the larger of the head's and the target's context. Refuses (``ValueError``) to write
    anything an engine would load wrong; ``out_dir`` must be absent or empty, or with ``overwrite`` an
    earlier draftsmith export (``EXPORT_MARKER``, written first into every export): a file, a training
    run, a head, a target or anyone's own folder is never replaced. ``verifier`` (speculators format
    only): the target as ``vllm serve DIR`` should load it, a Hub id or a path, written as given
    (default: the head's target by Hub id; a local path is never written unless given here).
    """
    bad = [name for name, t in head.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"refusing to export: the head has NaN or infinite weights in {bad[:6]}"
                         f"{' ...' if len(bad) > 6 else ''} (a diverged training run?)")
    count("num_speculative_tokens", num_speculative_tokens)
    if max_position_embeddings is not None:
        count("max_position_embeddings", max_position_embeddings)
    kinds = _format(fmt).kinds
    if head.head_kind not in kinds:
        raise ValueError(f"format '{fmt}' exports {' and '.join(kinds)} heads, got a {head.head_kind} head")
    kind = head.head_kind
    if target is not None:
        head.check_target(target)
    if verifier is not None and fmt != "speculators":
        raise ValueError(f"verifier= names the target in speculators configs only, not in '{fmt}' exports")
    if verifier is not None and not str(verifier).strip():
        raise ValueError("verifier= is empty: give the target's Hub id or path")
    facts = _target_facts(head, target)
    if verifier is not None:
        facts["name_or_path"] = str(verifier)
    context = max(head.config.max_position_embeddings if kind not in ("medusa", "mtp") else 0,
                  facts["max_position_embeddings"])
    options = {
        "dtype": dtype,
        "num_speculative_tokens": num_speculative_tokens,
        "max_position_embeddings": context if max_position_embeddings is None else max_position_embeddings,
        **_target_weights(target),
    }
    artifact = FORMATS[fmt].build(head, facts, options)
    raise_problems(validate_artifact(artifact.config, artifact.tensors, fmt), f"refusing to export as '{fmt}'")

    out = Path(out_dir)
    _check_destination(out, head)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is a file, not a directory; choose another --out (a file is never replaced)")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (--overwrite) to replace it")
        if not (out / EXPORT_MARKER).is_file():
            names = sorted(p.name for p in out.iterdir())
            raise ValueError(f"refusing to replace {out}: it is not an export written by draftsmith (no {EXPORT_MARKER}; "
                             f"holds {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); --overwrite replaces "
                             "only draftsmith's own exports: choose another --out or empty it yourself")
    _publish(artifact, head, out, fmt)
    return out


def _publish(artifact: Artifact, head: DraftHead, out: Path, fmt: str) -> None:
    """Write the export into a staging folder beside ``out``, check it as read back from disk, then put it in
    ``out``'s place (an earlier draftsmith export there is replaced; ``out`` was checked by the caller)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / EXPORT_MARKER).write_text(f"a draftsmith export ({fmt}): --overwrite may replace this folder\n")
        _write(artifact, staging)
        _write_card(head, staging, fmt, artifact.config)
        validate_export(staging, fmt)
        written = read_tensors(staging / artifact.weights_file)
        changed = [name for name, tensor in artifact.tensors.items() if not torch.equal(written[name], tensor)]
        if changed:
            raise ValueError(f"{staging / artifact.weights_file}: tensors {changed} changed on disk")
        share_readable(staging)  # mkdtemp is 0700, save_file 0600
        if out.is_dir() and (out / EXPORT_MARKER).is_file():  # ours (checked by export_head)
            shutil.rmtree(out)
        elif out.is_dir():
            out.rmdir()  # empty (checked by export_head); fails rather than delete anything that appeared since
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


# What a training run or a draftsmith head directory holds; an export holds none of these.
_RUN_MARKERS = ("checkpoints", "best", "metrics.jsonl", "config.yaml")


def _check_destination(out: Path, head: DraftHead) -> None:
    """Refuse an ``out`` that is, contains or lies inside the directory the head was loaded from, or that
    holds a training run or a draftsmith head: replacing it would lose the trained head."""
    source = getattr(head, "name_or_path", "") or ""
    target = out.resolve()
    if source and Path(source).is_dir():
        source_dir = Path(source).resolve()
        if target == source_dir or source_dir in target.parents or target in source_dir.parents:
            relation = "is" if target == source_dir else "lies inside" if source_dir in target.parents else "contains"
            raise ValueError(f"refusing to write the export to {out}: it {relation} the head's own directory "
                             f"{source}; choose an --out outside it")
    if not target.is_dir():
        return
    found = [name for name in _RUN_MARKERS if (target / name).exists()]
    config = target / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
            model_type = None
        if is_head_model_type(model_type):
            found.append(f"a draftsmith head (config.json model_type={model_type})")
    if found:
        raise ValueError(f"refusing to write the export to {out}: it holds {', '.join(found)} of a training run or "
                         "head, which overwriting would delete; choose another --out")


def _target_weights(target: PretrainedConfig | PreTrainedModel | None) -> dict[str, Tensor | None]:
    """The target's input embedding (speculators EAGLE-3 exports carry it) and lm_head (DSpark's SGLang layout
    carries both), (V, H_t) each, when the target is a model; None otherwise."""
    model = isinstance(target, PreTrainedModel)
    return {"embedding": target.get_input_embeddings().weight if model else None,
            "lm_head": target.get_output_embeddings().weight if model else None}


def _format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format '{fmt}'; expected one of {list(FORMATS)}")
    return FORMATS[fmt]


def _target_facts(head: DraftHead, target: PretrainedConfig | PreTrainedModel | None) -> dict[str, Any]:
    """The target facts recorded in the head, completed by ``target`` when given."""
    facts = {field: getattr(head.config, f"target_{field}") for field in _TARGET_FIELDS}
    if target is not None:
        facts.update({k: v for k, v in target_identity(target).items() if v})
    facts["name_or_path"] = public_target_name(facts["name_or_path"]) or ""  # never a path of this machine
    return facts


def _write(artifact: Artifact, directory: Path) -> None:
    (directory / "config.json").write_text(json.dumps(artifact.config, indent=2) + "\n")
    save_file(artifact.tensors, str(directory / artifact.weights_file), metadata={"format": "pt"})


def _write_card(head: DraftHead, directory: Path, fmt: str, config: dict[str, Any]) -> None:
    """README.md stating the format, the engines, (EAGLE-3) the layer convention written and what the format
    was checked against."""
    card = model_card(head, fmt=fmt, export_config=config)
    (directory / "README.md").write_text(card.rstrip("\n") + "\n" + checked_section(fmt))


def validate_export(path: str | Path, fmt: str) -> None:
    """Check a directory in format ``fmt`` as its engine would read it; ``ValueError`` lists every problem."""
    directory = Path(path)
    config = read_json_object(directory / "config.json")
    tensors = read_tensors(directory / _format(fmt).weights_file)
    raise_problems(validate_artifact(config, tensors, fmt), f"{directory} is not a valid '{fmt}' export")


def validate_artifact(config: dict[str, Any], tensors: dict[str, Tensor], fmt: str) -> list[str]:
    """Problems (empty when none) of a config + tensors pair in format ``fmt``."""
    return _format(fmt).problems(config, tensors)
