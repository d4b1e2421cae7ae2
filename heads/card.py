"""Model cards (README.md) for heads and their engine exports (publishing them: ``heads.hub``).

A card states what the head was made for, how it reads the target (for EAGLE-3: the aux layers and
their convention in each engine), what it was trained on and the measured simulated τ when the head
directory has the training loop's files, and how to serve it with draftsmith, vLLM, SGLang,
TensorRT-LLM or TGI.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCardData

from draftsmith.data.base.names import is_demo, public_target_name
from draftsmith.heads.common import DraftHead

METRICS_FILE = "metrics.jsonl"  # train.run: one JSON record per line; evaluations carry "tau", "acc", ...
TRAIN_CONFIG_FILE = "config.yaml"  # train.run: the resolved TrainConfig
TRAINING_FILES = (METRICS_FILE, TRAIN_CONFIG_FILE)  # uploaded with the head when present


@dataclass
class TrainingInfo:
    """What a head directory says about its training."""

    config: dict[str, Any] | None  # the resolved training config (config.yaml)
    best: dict[str, Any] | None  # the evaluation record with the highest simulated τ
    evaluations: int  # evaluation records in metrics.jsonl


def training_info(head_dir: str | Path) -> TrainingInfo | None:
    """The training config and best held-out evaluation found in ``head_dir``; None when it has neither."""
    directory = Path(head_dir)
    config_path, metrics_path = directory / TRAIN_CONFIG_FILE, directory / METRICS_FILE
    if not config_path.is_file() and not metrics_path.is_file():
        return None
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else None
    evaluations = []
    if metrics_path.is_file():
        for number, line in enumerate(metrics_path.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{metrics_path}:{number} is not JSON ({err})") from err
            if "tau" in record:
                evaluations.append(record)
    best = max(evaluations, key=lambda r: r["tau"]) if evaluations else None
    return TrainingInfo(config if isinstance(config, dict) else None, best, len(evaluations))


# ------------------------------------------------------------------------------------------ card


def model_card(
    head: DraftHead,
    *,
    repo_id: str | None = None,
    fmt: str | None = None,
    export_config: dict[str, Any] | None = None,
    training: TrainingInfo | None = None,
) -> str:
    """README.md text: Hub front matter, target, input convention, training, usage.

    ``fmt``/``export_config``: the card describes an engine export (what was written to config.json);
    ``repo_id``: usage snippets point at the Hub repo instead of a placeholder directory.
    """
    cfg, kind = head.config, head.head_kind
    target = public_target_name(cfg.target_name_or_path)  # never a path of this machine
    tags = ["speculative-decoding", kind, "draft-model"] + ([fmt] if fmt else [])
    front = ModelCardData(base_model=target, library_name="draftsmith", tags=tags).to_yaml()
    where = f"the `{fmt}` serving format" if fmt else "draftsmith's own format"
    lines = [
        "---", front, "---", "",
        f"# {head.title} draft head for `{target or cfg.target_architecture or 'an unnamed target'}`", "",
        f"Draft head ({head.title}) for lossless speculative decoding, made with draftsmith and "
        f"stored in {where}. It drafts tokens that the "
        "target verifies, so outputs are exactly the target's own; only the speed depends on the head.", "",
        "## Target", "",
        "| field | value |", "|---|---|",
        f"| name_or_path | {f'`{target}`' if target else 'a local model (its path is not recorded here)'} |",
        *_adapter_lines(cfg),
        *(f"| {field} | `{getattr(cfg, 'target_' + field) or 'unknown'}` |" for field in
          ("architecture", "model_type", "hidden_size", "num_layers", "vocab_size", "max_position_embeddings")),
        "", "## What the head reads", "", *head.card_input_lines(export_config), "",
    ]
    if training is not None:
        lines += ["## Training", "", *_training_lines(training), ""]
    lines += ["## Usage", "", *_usage_lines(head, repo_id, fmt), ""]
    return "\n".join(lines)


def _adapter_lines(cfg) -> list[str]:
    """A target derived from another (a PEFT adapter, Medusa-2's merged target): the row naming its base."""
    base = getattr(cfg, "target_base_name_or_path", "")
    if not base:
        return []
    shown = public_target_name(base)
    return [f"| base model | {f'`{shown}`' if shown else 'a local model'} (the target is derived from it: a PEFT "
            "adapter on it, merged before decoding, or a Medusa-2 run's fine-tune of it) |"]


def _training_lines(info: TrainingInfo) -> list[str]:
    lines = []
    config = info.config or {}
    data, opt = config.get("data") or {}, config.get("train") or {}
    if data:
        lines.append(f"- data: `{_source_name(data.get('train'))}` (max_length {data.get('max_length')}), "
                     f"held-out: `{_source_name(data.get('eval'))}`")
    if opt:
        budget = f"{opt['max_steps']} steps" if opt.get("max_steps") else f"{opt.get('epochs')} epoch(s)"
        lines.append(f"- {budget}, lr {opt.get('lr')}, micro-batch {opt.get('micro_batch_size')} x "
                     f"{opt.get('grad_accum_steps')} accumulation, precision {opt.get('mixed_precision')}")
    if info.best is not None:
        best = info.best
        lines.append(f"- best held-out **simulated τ {best['tau']:.3f}** at step {best.get('step')} "
                     f"({info.evaluations} evaluations, {best.get('positions', '?')} positions; greedy, "
                     "teacher-forced: real decoding τ also depends on the tree)")
        if best.get("acc"):
            lines.append(f"- per-step top-1 accuracy acc_k: {', '.join(f'{a:.3f}' for a in best['acc'])}")
    return lines or ["- no training record in this directory"]


def _source_name(source: Any) -> Any:
    """A data source as a card may name it: a local file by its name only, never its path."""
    if isinstance(source, str) and ("/" in source or "\\" in source) and not source.startswith("stdlib:"):
        return Path(source).name
    return source


def _usage_lines(head: DraftHead, repo_id: str | None, fmt: str | None) -> list[str]:
    cfg = head.config
    target = public_target_name(cfg.target_name_or_path) or "TARGET"
    native = fmt is None
    head_ref = repo_id or ("HEAD_DIR" if native else "DRAFT_DIR")
    serve_dir = head_ref if not native else "SERVE_DIR"
    lines: list[str] = []
    if native or fmt in head.reads_formats:
        lines += ["draftsmith (loads this " + ("head" if native else "export, converting it back") + "):", "",
                  "```python", "from draftsmith.infer import SpeculativeGenerator", "",
                  f"gen = SpeculativeGenerator.from_pretrained({target!r}, {head_ref!r})",
                  "out = gen.generate(input_ids, max_new_tokens=128)", "```", ""]

    def export_step(to: str) -> list[str]:
        if not native:
            return []
        return ["```bash", f"draftsmith export --head {head_ref} --to {to} --out {serve_dir}", "```"]

    served = target  # what an engine loads: a demo name is ours alone
    if is_demo(target):
        served = "TARGET_DIR"
        lines += [f"(Engines load a directory: TARGET_DIR is {target}'s, printed by "
                  f"`python -c \"from draftsmith.data.targets import resolve_target; print(resolve_target('{target}'))\"`.)", ""]
    lines += head.card_serving_lines(served, serve_dir, export_step, fmt)
    return lines


# ------------------------------------------------------------------------------------------- hub
