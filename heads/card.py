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

from data.base.names import is_demo, public_target_name
from heads.common import DraftHead
from heads.eagle3 import engine_aux_layer_ids

METRICS_FILE = "metrics.jsonl"  # train.loop: one JSON record per line; evaluations carry "tau", "acc", ...
TRAIN_CONFIG_FILE = "config.yaml"  # train.loop: the resolved TrainConfig
TRAINING_FILES = (METRICS_FILE, TRAIN_CONFIG_FILE)  # uploaded with the head when present
_TITLES = {"medusa": "Medusa", "eagle": "EAGLE (1/2)", "eagle3": "EAGLE-3", "dflash": "DFlash",
           "early-exit": "early exit (Kangaroo)"}


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
        f"# {_TITLES[kind]} draft head for `{target or cfg.target_architecture or 'an unnamed target'}`", "",
        f"Draft head ({_TITLES[kind]}) for lossless speculative decoding, made with draftsmith and "
        f"stored in {where}. It drafts tokens that the "
        "target verifies, so outputs are exactly the target's own; only the speed depends on the head.", "",
        "## Target", "",
        "| field | value |", "|---|---|",
        f"| name_or_path | {f'`{target}`' if target else 'a local model (its path is not recorded here)'} |",
        *_adapter_lines(cfg),
        *(f"| {field} | `{getattr(cfg, 'target_' + field) or 'unknown'}` |" for field in
          ("architecture", "model_type", "hidden_size", "num_layers", "vocab_size", "max_position_embeddings")),
        "", "## What the head reads", "", *_input_lines(head, export_config), "",
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


def _input_lines(head: DraftHead, export_config: dict[str, Any] | None) -> list[str]:
    cfg = head.config
    if head.head_kind == "medusa":
        return [f"- the target's final post-norm hidden state (its lm_head input); {cfg.num_heads} heads of "
                f"{cfg.num_layers} residual block(s) each, head k predicts token t+k+2 (the target predicts t+1)"]
    if head.head_kind == "eagle":
        return ["- the target's final post-norm hidden state f_i and the target's embedding of token i+1 "
                "(embedding first in the fc input); drafts with the target's own lm_head"]
    if head.head_kind == "early-exit":
        return [f"- the target's state after its first **{cfg.exit_layer}** layers (HF `hidden_states[{cfg.exit_layer}]`); "
                "one attention layer and a norm (Kangaroo's adapter); drafts with the target's own lm_head"]
    if head.head_kind == "dflash":
        ids = list(cfg.aux_layer_ids)
        return [f"- context: the target's states **{ids}** as HF `output_hidden_states` indices (the output of "
                f"target layers **{[i - 1 for i in ids]}**, DFlash's `target_layer_ids`), fused by fc + hidden_norm",
                f"- blocks of {cfg.block_size} tokens (the last accepted token, then mask id {cfg.mask_token_id}); "
                f"{cfg.num_layers} draft layer(s); drafts with the target's own embedding and lm_head"]
    ids = list(cfg.aux_layer_ids)
    lines = [
        f"- aux layers **{ids}** as HF `output_hidden_states` indices: the residual stream *entering* layer k "
        "(0 = embeddings). This is the convention of draftsmith and of vLLM's top-level "
        "`eagle_aux_hidden_state_layer_ids`.",
        f"- in the *output of layer k* convention of SGLang (`eagle_config.eagle_aux_hidden_state_layer_ids`) and "
        f"TensorRT-LLM (`eagle3_layers_to_capture`) the same layers are **{[i - 1 for i in ids]}**.",
        f"- draft vocabulary: {cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens"
        + (" (`d2t` offsets: target id = draft id + d2t[draft id]; `t2d` marks the draft tokens)"
           if cfg.reduced_vocab else " (the full vocabulary; no d2t/t2d)"),
    ]
    if export_config is None:
        return lines
    if "eagle_config" in export_config:
        lines.append(f"- this export writes `eagle_aux_hidden_state_layer_ids: {ids}` and "
                     f"`eagle_config.eagle_aux_hidden_state_layer_ids: {[i - 1 for i in ids]}`, each in its "
                     "engine's convention")
    elif "speculators_model_type" in export_config:
        lines.append(f"- this export writes `eagle_aux_hidden_state_layer_ids: {ids}` (vLLM's convention)")
    else:
        lines.append("- this export writes no layer ids: they equal every engine's default [2, L//2, L-3] for "
                     f"this {cfg.target_num_layers}-layer target, which each engine computes itself")
    return lines


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
    kind, cfg = head.head_kind, head.config
    target = public_target_name(cfg.target_name_or_path) or "TARGET"
    native = fmt is None
    head_ref = repo_id or ("HEAD_DIR" if native else "DRAFT_DIR")
    serve_dir = head_ref if not native else "SERVE_DIR"
    lines: list[str] = []
    if native or (kind == "eagle3" and fmt in ("vllm", "sglang", "speculators")) or kind == "dflash":
        lines += ["draftsmith (loads this " + ("head" if native else "export, converting it back") + "):", "",
                  "```python", "from infer import SpeculativeGenerator", "",
                  f"gen = SpeculativeGenerator.from_pretrained({target!r}, {head_ref!r})",
                  "out = gen.generate(input_ids, max_new_tokens=128)", "```", ""]

    def export_step(to: str) -> list[str]:
        if not native:
            return []
        return ["```bash", f"python scripts/export.py --head {head_ref} --to {to} --out {serve_dir}", "```"]

    served = target  # what an engine loads: a demo name is ours alone
    if is_demo(target):
        served = "TARGET_DIR"
        lines += [f"(Engines load a directory: TARGET_DIR is {target}'s, printed by "
                  f"`python -c \"from data.targets import resolve_target; print(resolve_target('{target}'))\"`.)", ""]
    if kind == "eagle3":
        lines += ["vLLM:", "", *export_step("vllm"), "```bash",
                  f"vllm serve {served} --speculative-config "
                  f"'{{\"method\": \"eagle3\", \"model\": \"{serve_dir}\", \"num_speculative_tokens\": 3}}'", "```", ""]
        if fmt != "speculators":
            lines += ["SGLang:", "", *export_step("sglang"), "```bash",
                      f"python -m sglang.launch_server --model-path {served} --speculative-algorithm EAGLE3 "
                      f"--speculative-draft-model-path {serve_dir} --speculative-num-steps 5 "
                      "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32", "```", "",
                      "TensorRT-LLM (PyTorch backend): `trtllm-serve " + served + " --config spec.yaml` with", "",
                      "```yaml", "speculative_config:", "  decoding_type: Eagle3", "  max_draft_len: 3",
                      f"  speculative_model: {serve_dir}", *_trtllm_layers(head), "```", ""]
    elif kind == "eagle":
        lines += ["vLLM:", "", *export_step("eagle-vllm"), "```bash",
                  f"vllm serve {served} --speculative-config "
                  f"'{{\"method\": \"eagle\", \"model\": \"{serve_dir}\", \"num_speculative_tokens\": 3}}'", "```", ""]
    elif kind == "dflash" and fmt == "speculators":
        lines += ["vLLM (the verifier, the block and the layers come from the directory):", "", "```bash",
                  f"vllm serve {serve_dir}", "```", ""]
    elif kind == "dflash":
        lines += ["vLLM (speculators flavour):", "", *export_step("speculators"), "```bash",
                  f"vllm serve {serve_dir}", "```", "",
                  "SGLang (and z-lab's `DFlashDraftModel` code):", "", *export_step("dflash"), "```bash",
                  f"python -m sglang.launch_server --model-path {served} --speculative-algorithm DFLASH "
                  f"--speculative-draft-model-path {serve_dir}", "```", ""]
    elif kind == "medusa":
        lines += ["vLLM:", "", *export_step("medusa-vllm"), "```bash",
                  f"vllm serve {served} --speculative-config '{{\"method\": \"medusa\", \"model\": \"{serve_dir}\", "
                  f"\"num_speculative_tokens\": {cfg.num_heads}}}'", "```", "",
                  "TGI (the target comes from `base_model_name_or_path`):", "", *export_step("medusa-tgi"),
                  "```bash", f"text-generation-launcher --model-id {serve_dir}", "```", ""]
    return lines


def _trtllm_layers(head: DraftHead) -> list[str]:
    ids, layers = list(head.config.aux_layer_ids), head.config.target_num_layers
    if layers and ids == engine_aux_layer_ids(layers):
        return []  # TensorRT-LLM's default {1, L//2 - 1, L - 4} is the same layers
    return [f"  eagle3_layers_to_capture: {[i - 1 for i in ids]}  # output of layer k"]


# ------------------------------------------------------------------------------------------- hub
