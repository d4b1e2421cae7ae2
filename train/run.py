"""Train a draft head on a frozen target: ``setup()`` -> ``main()`` -> ``fit()``.

``setup`` resolves the target and builds the ``Accelerator``; ``main`` loads target, data and head,
resumes if asked, calls ``fit`` and writes the output directory; ``fit`` is the loop (``train.fit``). Everything
that depends on the head's kind lives in its objective (``train.objectives``): each batch runs the
frozen target exactly once (``Objective.features``), keeping only what the head reads, or reads its
states from a dump or cache (``train.feature_source``: ``data.features`` / ``data.feature_cache``), and the head
and its loss are one module so that DDP sees one forward per backward. Evaluation is in
``train.evaluation``, checkpoints and resume in ``train.resume``, the run's card in ``train.run_card``.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader
from transformers import get_scheduler

from draftsmith.data.base.checks import at_most
from draftsmith.data.targets import load_target, load_target_tokenizer, resolve_target
from draftsmith.heads import build_head
from draftsmith.target.recurrent import check_supported
from draftsmith.target.model import decoder_layers, loaded_target_identity
from draftsmith.target.threads import choose_threads
from draftsmith.train.launcher import threads_are_launcher_default
from draftsmith.train.backbone import LORA_ADAPTER, MERGED_TARGET, save_merged_target
from draftsmith.train.checkpoint import BEST, CHECKPOINTS, METRICS_FILE
from draftsmith.train.config import TrainConfig
from draftsmith.train.evaluation import eval_and_keep_best
from draftsmith.train.examples import IndexedRows, collate, data_sources, load_examples, run_cache_dir
from draftsmith.train.feature_source import FeatureSource
from draftsmith.train.fit import fit
from draftsmith.train.metrics_log import MetricsLog
from draftsmith.train.objectives import HeadSetup, objective_class
from draftsmith.train.output_dir import check_output_dir
from draftsmith.train.resume import TrainState, mark_run, resume, resume_settings
from draftsmith.train.run_card import run_card
from draftsmith.train.target_sharding import shard_target
from draftsmith.train.warm_start import warm_start

logger = logging.getLogger("draftsmith.train")

_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- setup -> main -> fit


@dataclass
class TrainResult:
    head: nn.Module  # the final head (also saved in output_dir)
    output_dir: Path
    metrics: dict  # final held-out metrics (empty without eval data)
    best_dir: Path | None
    best_tau: float
    steps: int
    tokens_per_second: float
    history: list[dict] = field(default_factory=list)


def setup(cfg: TrainConfig) -> TrainResult:
    """Resolve the target (before any ``Accelerator`` exists: the demo build makes its own), then train."""
    check_output_dir(cfg)  # before the (maybe long) demo build
    _choose_cpu_threads(cfg.train.micro_batch_size * cfg.data.max_length)  # before the demo build too
    target_path = resolve_target(cfg.target)
    output_dir = Path(cfg.output_dir)
    trackers = [name for name, on in (("wandb", cfg.log.wandb), ("tensorboard", cfg.log.tensorboard)) if on]
    accelerator = Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    logger.setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)
    _check_launch(accelerator)
    try:
        return main(accelerator, cfg, target_path)
    finally:
        accelerator.end_training()


# The thread probe's matmul height for training: a micro-batch's tokens, capped (a larger probe only takes longer)
PROBE_ROWS_CAP = 1024


def _choose_cpu_threads(tokens: int) -> None:
    """The one thread policy (``target.threads``) for CPU training, also under ``accelerate launch``: its default
    of 1 thread per process is measured against every core when one process has them all; a count the user
    set (``OMP_NUM_THREADS``, ``--num_cpu_threads_per_process N``) is kept. Several processes keep theirs."""
    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true"):
        return
    alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
    line = choose_threads(ignore_env=alone and threads_are_launcher_default(), rows=min(tokens, PROBE_ROWS_CAP),
                          override="OMP_NUM_THREADS=N or accelerate launch --num_cpu_threads_per_process N overrides")
    if os.environ.get("RANK", "0") == "0":
        print(f"training {line}", file=sys.stderr, flush=True)


def _check_launch(accelerator: Accelerator) -> None:
    """Refuse several processes that each think they are alone (they would all train on all data
    and write the same files): ``accelerate launch --multi_gpu`` on a machine without GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{world} processes were launched but accelerate runs each as a single process (no GPU here). "
            f"For multi-process CPU training launch with ACCELERATE_USE_CPU=1, e.g. ACCELERATE_USE_CPU=1 "
            f"accelerate launch --multi_gpu --num_processes {world} train/train_head.py ...")
    if world == 1 and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") \
            and "MASTER_ADDR" in os.environ:
        logger.warning("accelerate launch --cpu starts a single process (accelerate runs several CPU processes "
                       "only through mpirun); for N CPU processes use ACCELERATE_USE_CPU=1 accelerate launch "
                       "--multi_gpu --num_processes N train/train_head.py ...")


@dataclass
class Run:
    """Everything built before training starts (shared by ``main`` and ``measure_throughput``)."""

    target: nn.Module
    tokenizer: Any
    identity: dict
    head: nn.Module
    train_set: Any  # datasets.Dataset of input_ids / loss_mask
    train_summary: Any  # data.pipeline.Summary
    eval_set: Any | None
    vocab_report: Any | None  # train.draft_vocab.DraftVocab for a reduced EAGLE-3 vocabulary
    depth: int  # draft steps simulated at evaluation
    pad_id: int


def load_frozen_target(cfg: TrainConfig, target_path: str, device, accelerator: Accelerator | None = None
                       ) -> tuple[Any, nn.Module, dict]:
    """(tokenizer, frozen target on ``device`` in the run's precision, its identity), checked against ``cfg``;
    with ``train.target_sharding=fsdp`` and several processes its decoder layers are sharded instead."""
    tokenizer = load_target_tokenizer(target_path)
    target = load_target(target_path, dtype=_DTYPES[cfg.train.mixed_precision])
    if cfg.target.startswith("demo:"):  # the head, card and exports name it "demo:<size>", not its cache path
        target.config._name_or_path = cfg.target
    target.requires_grad_(False).eval()
    decoder_layers(target)  # an encoder (BERT) is refused here alike for every head kind
    check_supported(target)  # a stateful model no head could decode with (pure Mamba, MiniMax, ...): one line
    # sharded before it moves: the device never holds the whole target (shard_target moves it)
    if not (accelerator is not None and cfg.train.target_sharding == "fsdp" and shard_target(target, accelerator)):
        target.to(device)
    identity = loaded_target_identity(target)
    vocab_size = identity["vocab_size"]
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer of {target_path} has {len(tokenizer)} tokens, more than the target's "
                         f"vocab_size={vocab_size}: they do not belong together")
    at_most("data.max_length", cfg.data.max_length, identity["max_position_embeddings"],
            of="the target's max_position_embeddings")
    if (cfg.head.draft_vocab_size or 0) > vocab_size:
        raise ValueError(f"head.draft_vocab_size={cfg.head.draft_vocab_size} exceeds the target's "
                         f"vocab_size={vocab_size}")
    return tokenizer, target, identity


def prepare_run(accelerator: Accelerator, cfg: TrainConfig, target_path: str) -> Run:
    """Load the frozen target and its tokenizer, the data, and a fresh head (draft vocab chosen)."""
    set_seed(cfg.seed)
    kind = cfg.head.kind
    tokenizer, target, identity = load_frozen_target(cfg, target_path, accelerator.device, accelerator)
    vocab_size = identity["vocab_size"]

    with accelerator.main_process_first():  # the first process regenerates (data.self_distill) and fills the cache
        train_source, eval_source = data_sources(cfg, target, tokenizer, progress=accelerator.is_main_process)
        train_set, train_summary = load_examples(train_source, tokenizer, cfg, vocab_size, "data.train")
        eval_set = None
        if eval_source is not None:
            eval_set, _ = load_examples(eval_source, tokenizer, cfg, vocab_size, "data.eval")
            if cfg.data.eval_rows is not None:
                eval_set = eval_set.select(range(min(cfg.data.eval_rows, len(eval_set))))
    logger.info("training data %s:\n%s", cfg.data.train, train_summary)

    head = build_head(kind, target, **cfg.head.build_options())
    objective = objective_class(kind, cfg.head.variant)
    vocab_report = objective.prepare_head(head, HeadSetup(
        accelerator, cfg, target, train_set, data_key=Path(train_summary.cache_path).name, vocab_size=vocab_size,
        cache_dir=run_cache_dir(cfg), tokenizer=tokenizer))
    if cfg.train.init_from is not None:  # a warm start replaces the fresh weights (kept: this run's target identity)
        warm_start(head, cfg.train.init_from)
        logger.info("head initialised from %s", cfg.train.init_from)
    depth = objective.eval_depth(head, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Run(target, tokenizer, identity, head, train_set, train_summary, eval_set, vocab_report, depth, pad_id)


def main(accelerator: Accelerator, cfg: TrainConfig, target_path: str) -> TrainResult:
    """Build the run; resume; ``fit``; write head, config, metrics and card."""
    output_dir = Path(cfg.output_dir)
    run = prepare_run(accelerator, cfg, target_path)
    target, head, depth, pad_id = run.target, run.head, run.depth, run.pad_id
    train_loader = DataLoader(IndexedRows(run.train_set), batch_size=cfg.train.micro_batch_size, shuffle=True,
                              collate_fn=lambda rows: collate(rows, pad_id))
    source = FeatureSource.for_run(accelerator, cfg, target, run.tokenizer,
                                   objective_class(cfg.head.kind, cfg.head.variant).aux_layer_ids(head), len(run.train_set))
    eval_loader = None
    if run.eval_set is not None:  # sharded by hand: no duplicated padding rows in the sums
        shard = run.eval_set.shard(accelerator.num_processes, accelerator.process_index, contiguous=True)
        eval_loader = DataLoader(shard, batch_size=cfg.train.micro_batch_size,
                                 collate_fn=lambda rows: collate(rows, pad_id))
    objective = objective_class(cfg.head.kind, cfg.head.variant)(head, cfg)
    objective.attach_backbone(target)  # Medusa-2: LoRA on the target, trained with the head
    optimizer = torch.optim.AdamW(objective.param_groups(), lr=cfg.train.lr, betas=cfg.train.betas,
                                  weight_decay=cfg.train.weight_decay)
    objective, optimizer, train_loader = accelerator.prepare(objective, optimizer, train_loader)
    per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if per_epoch == 0 and cfg.train.max_steps is None:
        raise ValueError(f"one epoch has {len(train_loader)} micro-batches per process, fewer than "
                         f"train.grad_accum_steps={cfg.train.grad_accum_steps}; set train.max_steps")
    max_steps = cfg.train.max_steps or per_epoch * cfg.train.epochs
    warmup = min(cfg.train.warmup_steps, max_steps)  # as HF Trainer: a short run is warm-up throughout
    if warmup < cfg.train.warmup_steps:
        logger.info("train.warmup_steps=%d capped at the run's %d steps", cfg.train.warmup_steps, max_steps)
    scheduler = get_scheduler({"constant": "constant_with_warmup"}.get(cfg.train.decay, cfg.train.decay),
                              optimizer, num_warmup_steps=warmup, num_training_steps=max_steps)
    state = TrainState()
    resumed = _resume_or_clean(accelerator, cfg, objective, optimizer, scheduler, state)
    state.settings = resume_settings(cfg)  # recorded in every checkpoint: what a resume must not change
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        mark_run(output_dir)  # first: the folder is ours from now on (train.output_dir)
        (output_dir / "config.yaml").write_text(cfg.to_yaml())
    accelerator.wait_for_everyone()
    accelerator.init_trackers(cfg.log.wandb_project, config=_flat(cfg.to_dict()),
                              init_kwargs={"wandb": {"name": cfg.log.run_name or output_dir.name,
                                                     "dir": str(output_dir)}})
    metrics_log = MetricsLog(accelerator, output_dir / METRICS_FILE, state.step if resumed else None)

    history, tokens_per_second = fit(accelerator, cfg, objective, target, optimizer, scheduler, train_loader,
                                     eval_loader, state, max_steps, depth, metrics_log, source)
    source.close()
    if source.store is not None:
        logger.info("%s: %d micro-batches read from stored features, %d run through the target", source.key,
                    source.read_batches, source.online_batches)

    head = accelerator.unwrap_model(objective).head
    evals = [r for r in history if "tau" in r]
    final: dict = {}
    if eval_loader is not None:  # reuse an evaluation of the last step if fit just made it
        final = evals[-1] if evals and evals[-1]["step"] == state.step else \
            eval_and_keep_best(accelerator, head, target, eval_loader, cfg, depth, state, metrics_log)
    accelerator.wait_for_everyone()
    best_dir = output_dir / BEST if (output_dir / BEST).is_dir() and eval_loader is not None else None
    if accelerator.is_main_process:
        backbone = accelerator.unwrap_model(objective).backbone
        if backbone is not None:  # Medusa-2: the heads draft for the merged target, saved beside them
            merged = save_merged_target(backbone, run.tokenizer, output_dir, target.config._name_or_path)
            head.config.target_name_or_path, head.config.target_base_name_or_path = str(merged), cfg.target
            logger.info("merged target saved to %s (adapter: %s)", merged, output_dir / LORA_ADAPTER)
        head.save_pretrained(output_dir)
        (output_dir / "README.md").write_text(run_card(head, output_dir, run.train_summary, final, state,
                                                         run.vocab_report))
        logger.info("head saved to %s", output_dir)
        if state.step >= max_steps:  # finished, not stopped by train.max_minutes: resume_from=latest has nothing to do
            mark_run(output_dir, complete={"step": state.step, "train.max_steps": cfg.train.max_steps,
                                           "train.epochs": cfg.train.epochs})
    accelerator.wait_for_everyone()
    return TrainResult(head, output_dir, final, best_dir, state.best_tau, state.step, tokens_per_second, history)


def _resume_or_clean(accelerator: Accelerator, cfg: TrainConfig, objective, optimizer, scheduler,
                     state: TrainState) -> Path | None:
    """``resume_from``'s checkpoint into the run (returns its path), or, for a fresh run, an earlier run's
    checkpoints, best head and merged target removed (a fresh run must not mix with them)."""
    output_dir = Path(cfg.output_dir)
    if cfg.resume_from is not None:
        resumed = resume(accelerator, cfg, output_dir, accelerator.unwrap_model(objective).head, optimizer,
                         scheduler, state, backbone=accelerator.unwrap_model(objective).backbone)
        logger.info("resumed from %s at step %d (kept from the checkpoint: head, optimizer, scheduler, RNG, data "
                    "position; unchanged: %s)", resumed, state.step, ", ".join(state.settings or ["(not recorded)"]))
        return resumed
    if accelerator.is_main_process:
        for stale in (output_dir / CHECKPOINTS, output_dir / BEST, output_dir / MERGED_TARGET, output_dir / LORA_ADAPTER):
            if stale.exists():  # only reached with overwrite_output_dir=true (check_output_dir)
                logger.warning("overwrite_output_dir=true: removing %s of an earlier run", stale)
                shutil.rmtree(stale)
    return None


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config -> flat scalar dict for the trackers' hyper-parameter tables."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
