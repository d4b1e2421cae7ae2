"""Train a draft head on a frozen target: ``setup()`` -> ``main()`` -> ``fit()``.

``setup`` resolves the target and builds the ``Accelerator``; ``main`` loads target, data and head,
resumes if asked, calls ``fit`` and writes the output directory; ``fit`` is the loop. Each batch
runs the frozen target exactly once (``target_features``), keeping only what the head reads; the
head and its loss live in ``Objective`` so that DDP sees one forward per backward.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import ProjectConfiguration, set_seed
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from data.base.paths import cache_root
from data.targets import hub_errors, resolve_target
from heads import HeadCache, build_head
from infer.target import decoder_layers, target_forward, loaded_target_identity
from infer.threads import choose_threads
from data.base.device import sync
from heads.layers import additive_mask
from train import checkpoint
from train.checkpoint import CHECKPOINTS
from train.config import DEFAULT_TTT_STEPS, ConfigError, TrainConfig, load_config
from train.divergence import DivergenceGuard, TrainingDiverged  # noqa: F401  (re-exported)
from train.draft_vocab import build_draft_vocab
from train.losses import DraftTargets, LossOutput, decayed_sum, eagle_loss, medusa_loss, restrict_to_draft_vocab, \
    ttt_step_loss
from train.metrics import AcceptanceMeter, format_acceptance, step_correctness

logger = logging.getLogger("draftsmith.train")

BEST = "best"
METRICS_FILE = "metrics.jsonl"
_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- one target forward per batch


@dataclass
class Features:
    """What the head needs from one batch, computed by one target forward (no grad)."""

    input_ids: Tensor  # (B, T)
    loss_mask: Tensor  # (B, T) 1 = token is a training target
    hidden: Tensor  # (B, T, H_t) final post-norm (medusa, eagle) or (B, T, n·H_t) aux (eagle3), fp32
    embeds: Tensor | None = None  # (B, T, H_t) target input embeddings (eagle, eagle3), fp32
    logits: Tensor | None = None  # (B, T, V) full target logits: eagle only (its soft labels)
    targets: DraftTargets | None = None  # eagle3: (B, T, Vd) soft labels + target top-1
    top1: Tensor | None = None  # (B, T) target argmax, when logits were computed
    noise: Tensor | None = None  # (B, T, H_t) EAGLE-1 augmentation, added to the head's input only


@torch.no_grad()
def target_features(target: nn.Module, batch: dict, kind: str, *, aux_layer_ids=(), t2d: Tensor | None = None,
                    need_top1: bool = False) -> Features:
    """Run the frozen target once over ``batch`` and keep only what a ``kind`` head reads.

    EAGLE-3's full-vocab logits are restricted to the draft vocab right here and dropped.
    """
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    with_logits = kind != "medusa" or need_top1
    out = target_forward(target, input_ids, aux_layer_ids=aux_layer_ids if kind == "eagle3" else (),
                         compute_logits=with_logits)
    embeds = None
    if kind != "medusa":
        embeds = target.get_input_embeddings()(input_ids).float()
    if kind == "eagle3":
        targets = restrict_to_draft_vocab(out.logits, t2d)
        return Features(input_ids, loss_mask, out.aux_hidden.float(), embeds, targets=targets, top1=targets.top1)
    top1 = out.logits.argmax(-1) if with_logits else None
    logits = out.logits if kind == "eagle" else None
    return Features(input_ids, loss_mask, out.final_hidden.float(), embeds, logits=logits, top1=top1)


def shift_left(x: Tensor, n: int) -> Tensor:
    """x (B, T, ...) shifted ``n`` positions to the left along T, zero-filled at the end."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]), *x.shape[2:])], dim=1)


def ttt_attention_mask(seq_len: int, step: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive (1, 1, T, (step+1)·T) mask ``[causal | diag | ... | diag]`` of training-time test:
    the query at t sees step 0's keys <= t and, of steps 1..step, only position t."""
    idx = torch.arange(seq_len, device=device)
    causal = idx[None, :] <= idx[:, None]  # (T, T)
    diag = idx[None, :] == idx[:, None]
    allowed = torch.cat([causal] + [diag] * step, dim=1)  # (T, (step+1)T)
    return additive_mask(allowed, dtype)


def unroll(head: nn.Module, hidden: Tensor, embeds: Tensor, steps: int) -> Iterator[Tensor]:
    """Draft ``steps`` steps in parallel over all positions (EAGLE training-time test).

    Step k at position i reads token i+1+k (teacher-forced) and step k-1's un-normed output,
    at RoPE position i+k; yields each step's output (B, T, H).
    """
    batch, seq_len, _ = hidden.shape
    cache = HeadCache()
    for k in range(steps):
        positions = (torch.arange(seq_len, device=hidden.device) + k).expand(batch, seq_len)
        mask = None if k == 0 else ttt_attention_mask(seq_len, k, hidden.dtype, hidden.device).expand(batch, -1, -1, -1)
        hidden = head(hidden_states=hidden, inputs_embeds=shift_left(embeds, 1 + k), position_ids=positions,
                      attention_mask=mask, past_key_values=cache).hidden_states
        yield hidden


class Objective(nn.Module):
    """The head and its training loss in one forward, so DDP wraps a single call per backward.

    The target's frozen lm_head (EAGLE-1) is passed in per call so it is never part of this
    module's parameters, state dict or checkpoints.
    """

    def __init__(self, head: nn.Module, cfg: TrainConfig) -> None:
        super().__init__()
        self.head = head
        self.kind = cfg.head.kind
        self.decay = cfg.train.loss_decay
        self.ttt_steps = cfg.head.ttt_steps

    def forward(self, features: Features, lm_head: nn.Module | None = None) -> LossOutput:
        f = features
        if self.kind == "medusa":
            return medusa_loss(self.head(f.hidden), f.input_ids, f.loss_mask, self.decay)
        if self.kind == "eagle":  # input f_i (+ noise) with token i+1; the regression target stays clean
            x = f.hidden if f.noise is None else f.hidden + f.noise
            out = self.head(hidden_states=x, inputs_embeds=shift_left(f.embeds, 1),
                            position_ids=torch.arange(f.hidden.shape[1], device=f.hidden.device).expand(
                                f.hidden.shape[:2])).hidden_states
            return eagle_loss(out, lm_head(out), f.hidden, f.logits, f.loss_mask)
        steps = [ttt_step_loss(self.head.compute_logits(out), f.targets, f.loss_mask, k)
                 for k, out in enumerate(unroll(self.head, self.head.project(f.hidden), f.embeds, self.ttt_steps))]
        return LossOutput(decayed_sum([s.loss for s in steps], self.decay),
                          *(torch.cat([getattr(s, n) for s in steps]) for n in ("step_losses", "correct", "count")))


@torch.no_grad()
def draft_top1(head: nn.Module, features: Features, depth: int, lm_head: nn.Module | None = None) -> Tensor:
    """(K, B, T) target-vocab ids the head drafts at steps 0..depth-1 of every position."""
    f = features
    if head.head_kind == "medusa":
        return head(f.hidden)[:depth].argmax(-1)
    if head.head_kind == "eagle":
        return torch.stack([lm_head(out).argmax(-1) for out in unroll(head, f.hidden, f.embeds, depth)])
    return torch.stack([head.draft_to_target(head.compute_logits(out).argmax(-1))
                        for out in unroll(head, head.project(f.hidden), f.embeds, depth)])


@torch.no_grad()
def evaluate(accelerator: Accelerator, head: nn.Module, target: nn.Module, loader: DataLoader, cfg: TrainConfig,
             depth: int) -> dict:
    """acc_k, cond_acc_k and simulated τ of ``head`` on this process's share of the held-out data,
    summed over processes; plus the share of target top-1 tokens the draft vocab covers."""
    was_training = head.training
    head.eval()
    meter = AcceptanceMeter(depth, accelerator.device)
    covered = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # [in draft vocab, masked]
    lm_head = target.get_output_embeddings()
    t2d = getattr(head, "t2d", None)
    for batch in loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.autocast():
            features = target_features(target, batch, cfg.head.kind, aux_layer_ids=head.feature_layer_ids,
                                       t2d=t2d, need_top1=True)
            drafted = draft_top1(head, features, depth, lm_head)
        meter.update(*step_correctness(drafted, features.top1, features.loss_mask))
        masked = features.loss_mask[:, 1:].bool()  # target top-1 at j predicts token j+1
        in_vocab = t2d[features.top1[:, :-1]] if t2d is not None else torch.ones_like(masked)
        covered += torch.stack([(in_vocab & masked).sum(), masked.sum()]).to(covered)
    meter.state = accelerator.reduce(meter.state, reduction="sum")
    covered = accelerator.reduce(covered, reduction="sum")
    head.train(was_training)
    metrics = meter.compute()
    metrics["draft_vocab_coverage"] = (covered[0] / covered[1].clamp(min=1)).item()
    return metrics


# ---------------------------------------------------------------- data


def collate(rows: list[dict], pad_id: int) -> dict[str, Tensor]:
    """Right-pad a list of examples to (B, T_max); padding has loss_mask 0."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    length = int(lengths.max())
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        mask[i, : len(r["loss_mask"])] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
    return {"input_ids": ids, "loss_mask": mask, "lengths": lengths}


def load_examples(source: str, tokenizer, cfg: TrainConfig, vocab_size: int, key: str):
    """Tokenized examples of ``source`` (``data.pipeline``), checked against the target's vocab."""
    from data.pipeline import build_examples

    try:
        examples, summary = build_examples(source, tokenizer, max_length=cfg.data.max_length,
                                           overlong=cfg.data.overlong, strict=cfg.data.strict,
                                           lenient_json=cfg.data.lenient_json, cache_dir=run_cache_dir(cfg) / "data")
    except ValueError as err:  # no usable rows, or a bad row under data.strict: say which source
        raise ValueError(f"{key}={source!r}: {err}") from err
    import pyarrow.compute as pc  # on the arrow column: no Python list per example

    column = examples.data.column("input_ids")
    if pc.max(pc.list_value_length(column)).as_py() < 3:
        raise ValueError(f"{key}={source!r}: every example is shorter than 3 tokens; nothing to draft")
    top = pc.max(pc.list_flatten(column)).as_py()
    if top >= vocab_size:
        raise ValueError(f"{key}={source!r} holds token id {top} but the target's vocab has {vocab_size} "
                         "tokens: the tokenizer does not belong to this target")
    return examples, summary


def run_cache_dir(cfg: TrainConfig) -> Path:
    """The cache a training run uses: ``cache_dir`` if set, else draftsmith's cache root."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_root()


# ---------------------------------------------------------------- checkpoints


@dataclass
class TrainState:
    """Loop position saved (as JSON) with every checkpoint."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # data position of the next micro-batch: epoch ...
    batch: int = 0  # ... and micro-batch index within it (per process)
    tokens: int = 0  # non-pad tokens trained on, all processes
    best_tau: float = -math.inf
    best_step: int = -1
    guard: dict = field(default_factory=dict)  # DivergenceGuard.state_dict()

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, if any (not checked for corruption: see ``resume``)."""
    return next(iter(checkpoint.checkpoint_steps(output_dir)), None)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, state: TrainState, head: nn.Module, optimizer,
                    scheduler, keep: int) -> Path:
    """Full training state (head, optimizer, scheduler, RNG, loop position) of step ``state.step``; no pickle."""
    path = output_dir / CHECKPOINTS / f"step-{state.step:07d}"
    checkpoint.save(path, head=head, optimizer=optimizer, scheduler=scheduler, loop_state=state.state_dict(),
                    rank=accelerator.process_index, is_main=accelerator.is_main_process,
                    barrier=accelerator.wait_for_everyone)
    if accelerator.is_main_process:
        checkpoint.prune(output_dir, keep)
    accelerator.wait_for_everyone()
    return path


def resume(accelerator: Accelerator, cfg: TrainConfig, output_dir: Path, head: nn.Module, optimizer, scheduler,
           state: TrainState) -> Path:
    """Load ``cfg.resume_from`` into head, optimizer, scheduler, RNGs and ``state``; return its path.

    ``latest`` takes the newest checkpoint that reads back intact; a corrupt one is named in a warning
    and the next older one is tried. An explicit path is loaded or refused, never replaced.
    """
    if cfg.resume_from == "latest":
        candidates = checkpoint.checkpoint_steps(output_dir)
        if not candidates:
            raise FileNotFoundError(f"resume_from=latest: no complete checkpoint in {output_dir / CHECKPOINTS}")
    else:
        candidates = [Path(cfg.resume_from)]
    for number, path in enumerate(candidates):
        try:
            loaded = checkpoint.read(path, accelerator.process_index)
        except checkpoint.CheckpointError as err:
            if cfg.resume_from != "latest" or number == len(candidates) - 1:
                raise
            logger.warning("cannot resume from %s: %s; falling back to %s", path, err, candidates[number + 1])
            continue
        check_resumable(loaded, head)
        checkpoint.apply(loaded, head=head, optimizer=optimizer, scheduler=scheduler)
        state.load_state_dict(loaded.state)
        return path
    raise AssertionError("unreachable")


def check_resumable(loaded: checkpoint.Checkpoint, head: nn.Module) -> None:
    """Fail loudly when a checkpoint was made for another head or target."""
    saved = loaded.head_config
    current = json.loads(head.config.to_json_string())
    ignore = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype"}  # set by saving
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {current.get(k)!r}"
            for k in sorted((set(saved) | set(current)) - ignore) if saved.get(k) != current.get(k)]
    if diff:
        raise ValueError(f"checkpoint {loaded.path} does not match this run's head/target:\n  " + "\n  ".join(diff))


def check_output_dir(cfg: TrainConfig) -> None:
    """A fresh run (no ``resume_from``) must not replace an earlier run's results unless asked to."""
    output_dir = Path(cfg.output_dir)
    if cfg.resume_from is not None or cfg.overwrite_output_dir or not output_dir.is_dir():
        return
    earlier = [name for name in (CHECKPOINTS, BEST, METRICS_FILE, "model.safetensors") if (output_dir / name).exists()]
    if earlier:
        steps = latest_checkpoint(output_dir)
        where = f" (latest checkpoint {steps.name})" if steps else ""
        raise ConfigError(f"output_dir={output_dir} holds an earlier run ({', '.join(earlier)}){where}: pass "
                          "resume_from=latest to continue it, overwrite_output_dir=true to replace it, or choose "
                          "another output_dir")


class MetricsLog:
    """Append-only ``metrics.jsonl`` (main process) mirrored to the accelerate trackers."""

    def __init__(self, accelerator: Accelerator, path: Path, resume_step: int | None) -> None:
        self.accelerator, self.path = accelerator, path
        if accelerator.is_main_process:
            lines = path.read_text().splitlines() if resume_step is not None and path.is_file() else []
            kept = [line for line in lines if json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        scalars = {}
        for name, value in record.items():
            if isinstance(value, list):
                scalars.update({f"{name}/{k}": v for k, v in enumerate(value)})
            elif isinstance(value, (int, float)):
                scalars[name] = value
        self.accelerator.log(scalars, step=record["step"])
        if self.accelerator.is_main_process:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


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


def parse_args(argv: list[str] | None = None, default_config: str | Path | None = None) -> TrainConfig:
    """``[--config FILE] [key=value ...]`` -> ``TrainConfig`` (``default_config`` when no --config)."""
    from train.config import ConfigError, help_text

    parser = argparse.ArgumentParser(
        prog="train_head.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a draft head on a frozen target.")
    parser.add_argument("--config", help="YAML config file (default: %(default)s)", default=default_config)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=100")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=default_config)
    chosen, _ = pre.parse_known_args(argv)
    try:  # --help shows the values this run would start from
        effective, where = load_config(chosen.config), f"values of {chosen.config} and the built-in defaults"
    except ConfigError:
        effective, where = None, "built-in defaults"
    parser.epilog = f"keys ({where}):\n" + help_text(effective)
    args = parser.parse_intermixed_args(argv)  # key=value before and after --config
    notes: list[str] = []
    cfg = load_config(args.config, args.overrides, default_file=args.config == default_config, notes=notes)
    for note in notes:
        print(note, file=sys.stderr)
    return cfg


def setup(cfg: TrainConfig) -> TrainResult:
    """Resolve the target (before any ``Accelerator`` exists: the demo build makes its own), then train."""
    check_output_dir(cfg)  # before the (maybe long) demo build
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


def _check_launch(accelerator: Accelerator) -> None:
    """Refuse several processes that each think they are alone (they would all train on all data
    and write the same files): ``accelerate launch --multi_gpu`` on a machine without GPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{world} processes were launched but accelerate runs each as a single process (no GPU here). "
            f"For multi-process CPU training launch with ACCELERATE_USE_CPU=1, e.g. ACCELERATE_USE_CPU=1 "
            f"accelerate launch --multi_gpu --num_processes {world} train/train_head.py ...")
    if accelerator.device.type == "cpu":  # accelerate launch sets OMP_NUM_THREADS (1 unless
        # --num_cpu_threads_per_process N); a plain `python train/train_head.py` measures
        logger.info("training %s", choose_threads())
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


def prepare_run(accelerator: Accelerator, cfg: TrainConfig, target_path: str) -> Run:
    """Load the frozen target and its tokenizer, the data, and a fresh head (draft vocab chosen)."""
    set_seed(cfg.seed)
    kind = cfg.head.kind
    with hub_errors(target_path):
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=_DTYPES[cfg.train.mixed_precision])
    if cfg.target.startswith("demo:"):  # the head, card and exports name it "demo:<size>", not its cache path
        target.config._name_or_path = cfg.target
    target.requires_grad_(False).eval().to(accelerator.device)
    decoder_layers(target)  # an encoder (BERT) is refused here alike for every head kind
    identity = loaded_target_identity(target)
    vocab_size = identity["vocab_size"]
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer of {target_path} has {len(tokenizer)} tokens, more than the target's "
                         f"vocab_size={vocab_size}: they do not belong together")
    if cfg.data.max_length > (identity["max_position_embeddings"] or math.inf):
        raise ValueError(f"data.max_length={cfg.data.max_length} exceeds the target's "
                         f"max_position_embeddings={identity['max_position_embeddings']}")
    if (cfg.head.draft_vocab_size or 0) > vocab_size:
        raise ValueError(f"head.draft_vocab_size={cfg.head.draft_vocab_size} exceeds the target's "
                         f"vocab_size={vocab_size}")

    with accelerator.main_process_first():  # the first process fills the data cache
        train_set, train_summary = load_examples(cfg.data.train, tokenizer, cfg, vocab_size, "data.train")
        eval_set = None
        if cfg.data.eval is not None:
            eval_set, _ = load_examples(cfg.data.eval, tokenizer, cfg, vocab_size, "data.eval")
            if cfg.data.eval_rows is not None:
                eval_set = eval_set.select(range(min(cfg.data.eval_rows, len(eval_set))))
    logger.info("training data %s:\n%s", cfg.data.train, train_summary)

    head = build_head(kind, target, **cfg.head.build_options())
    vocab_report = None
    if kind == "eagle3" and head.config.reduced_vocab:
        with accelerator.main_process_first():
            vocab_report = build_draft_vocab(
                train_set, vocab_size=vocab_size, size=head.config.draft_vocab_size,
                data_key=Path(train_summary.cache_path).name, cache_dir=run_cache_dir(cfg) / "draft_vocab")
        head.set_draft_vocab(vocab_report.ids)
        logger.info("draft vocab: %d of %d tokens cover %.1f%% of training targets (%s)",
                    head.config.draft_vocab_size, vocab_size, 100 * vocab_report.coverage, vocab_report.cache_path)
    if kind == "eagle3" and cfg.head.init_from_target:
        head.init_from_target(target)
        logger.info("EAGLE-3 norm and lm_head start from the target's final norm and lm_head rows")
    if cfg.train.eval_depth is not None:
        depth = cfg.train.eval_depth
    elif kind == "medusa":
        depth = head.config.num_heads
    else:
        depth = cfg.head.ttt_steps if kind == "eagle3" else DEFAULT_TTT_STEPS
    if kind == "medusa" and depth > head.config.num_heads:
        raise ValueError(f"train.eval_depth={depth} exceeds the Medusa head's num_heads={head.config.num_heads}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return Run(target, tokenizer, identity, head, train_set, train_summary, eval_set, vocab_report, depth, pad_id)


def main(accelerator: Accelerator, cfg: TrainConfig, target_path: str) -> TrainResult:
    """Build the run; resume; ``fit``; write head, config, metrics and card."""
    output_dir = Path(cfg.output_dir)
    run = prepare_run(accelerator, cfg, target_path)
    target, head, depth, pad_id = run.target, run.head, run.depth, run.pad_id
    train_loader = DataLoader(run.train_set, batch_size=cfg.train.micro_batch_size, shuffle=True,
                              collate_fn=lambda rows: collate(rows, pad_id))
    eval_loader = None
    if run.eval_set is not None:  # sharded by hand: no duplicated padding rows in the sums
        shard = run.eval_set.shard(accelerator.num_processes, accelerator.process_index, contiguous=True)
        eval_loader = DataLoader(shard, batch_size=cfg.train.micro_batch_size,
                                 collate_fn=lambda rows: collate(rows, pad_id))
    objective = Objective(head, cfg)
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.train.lr, betas=cfg.train.betas,
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
    resumed = None
    if cfg.resume_from is not None:
        resumed = resume(accelerator, cfg, output_dir, accelerator.unwrap_model(objective).head, optimizer,
                         scheduler, state)
        logger.info("resumed from %s at step %d", resumed, state.step)
    elif accelerator.is_main_process:  # a fresh run must not mix with an earlier run's checkpoints
        for stale in (output_dir / CHECKPOINTS, output_dir / BEST):
            if stale.exists():  # only reached with overwrite_output_dir=true (check_output_dir)
                logger.warning("overwrite_output_dir=true: removing %s of an earlier run", stale)
                shutil.rmtree(stale)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(cfg.to_yaml())
    accelerator.wait_for_everyone()
    accelerator.init_trackers(cfg.log.wandb_project, config=_flat(cfg.to_dict()),
                              init_kwargs={"wandb": {"name": cfg.log.run_name or output_dir.name,
                                                     "dir": str(output_dir)}})
    metrics_log = MetricsLog(accelerator, output_dir / METRICS_FILE, state.step if resumed else None)

    history, tokens_per_second = fit(accelerator, cfg, objective, target, optimizer, scheduler, train_loader,
                                     eval_loader, state, max_steps, depth, metrics_log)

    head = accelerator.unwrap_model(objective).head
    evals = [r for r in history if "tau" in r]
    final: dict = {}
    if eval_loader is not None:  # reuse an evaluation of the last step if fit just made it
        final = evals[-1] if evals and evals[-1]["step"] == state.step else \
            _eval_and_keep_best(accelerator, head, target, eval_loader, cfg, depth, state, metrics_log)
    accelerator.wait_for_everyone()
    best_dir = output_dir / BEST if (output_dir / BEST).is_dir() and eval_loader is not None else None
    if accelerator.is_main_process:
        head.save_pretrained(output_dir)
        (output_dir / "README.md").write_text(run_card(head, output_dir, run.train_summary, final, state,
                                                         run.vocab_report))
        logger.info("head saved to %s", output_dir)
    accelerator.wait_for_everyone()
    return TrainResult(head, output_dir, final, best_dir, state.best_tau, state.step, tokens_per_second, history)


def fit(accelerator: Accelerator, cfg: TrainConfig, objective: nn.Module, target: nn.Module,
        optimizer: torch.optim.Optimizer, scheduler, train_loader: DataLoader, eval_loader: DataLoader | None,
        state: TrainState, max_steps: int, depth: int, metrics_log: MetricsLog) -> tuple[list[dict], float]:
    """The training loop; returns the logged records and the training tokens/s (all processes)."""
    opt = cfg.train
    head = accelerator.unwrap_model(objective).head
    kind = cfg.head.kind
    lm_head = target.get_output_embeddings() if kind == "eagle" else None
    t2d = getattr(head, "t2d", None)
    output_dir = Path(cfg.output_dir)
    micro_batches = _micro_batches(accelerator, train_loader, state)
    history: list[dict] = []
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "correct": 0, "count": 0, "seconds": 0.0}
    run_tokens, run_seconds = 0, 0.0  # training steps only: evaluation and checkpoints excluded
    guard = DivergenceGuard(check_grad=opt.mixed_precision != "fp16")
    guard.load_state_dict(state.guard)
    objective.train()
    # disable=None: no bar when stderr is not a terminal (log files get the log lines, not bar frames)
    bar = tqdm(total=max_steps, initial=state.step, desc=f"train {kind}",
               disable=None if accelerator.is_main_process else True)
    with bar, logging_redirect_tqdm():  # the bar is closed before any error is printed
        while state.step < max_steps:
            step_start = time.perf_counter()
            step_loss = torch.zeros((), device=accelerator.device)
            tokens = 0
            for micro in range(opt.grad_accum_steps):
                batch = next(micro_batches)
                features = target_features(target, batch, kind, aux_layer_ids=head.feature_layer_ids, t2d=t2d)
                if kind == "eagle" and opt.feature_noise:  # U(-a, a), reproducible on resume
                    generator = torch.Generator(accelerator.device).manual_seed(
                        _noise_seed(cfg.seed, state.step, micro, accelerator.process_index))
                    noise = torch.rand(features.hidden.shape, generator=generator, device=accelerator.device)
                    features.noise = (2 * noise - 1) * opt.feature_noise
                last = micro == opt.grad_accum_steps - 1
                with nullcontext() if last else accelerator.no_sync(objective):
                    out = objective(features, lm_head)
                    accelerator.backward(out.loss / opt.grad_accum_steps)
                step_loss += out.loss.detach() / opt.grad_accum_steps
                window["correct"] = window["correct"] + out.correct
                window["count"] = window["count"] + out.count
                tokens += int(batch["lengths"].sum())
            tokens = int(accelerator.reduce(torch.tensor(tokens, device=accelerator.device), "sum"))
            step_loss = accelerator.reduce(step_loss, reduction="mean")
            grad_norm = accelerator.clip_grad_norm_(objective.parameters(), opt.max_grad_norm)
            # note: a host-device sync point, once per optimizer step; a diverged step must never be saved
            problem = guard.check_step(state.step + 1, step_loss.item(), float(grad_norm))
            if problem is None:
                norm_before = _weight_norm(head)
                optimizer.step()
                problem = guard.check_update(state.step + 1, norm_before, _weight_norm(head))
            if problem is not None:
                last_good = latest_checkpoint(output_dir)
                raise TrainingDiverged(
                    f"training diverged: {problem}; stopped without saving. Last good checkpoint: "
                    f"{last_good or 'none'}{' (continue with resume_from=latest)' if last_good else ''}. Try a "
                    "lower train.lr or train.mixed_precision=bf16.")
            state.guard = guard.state_dict()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            seconds = time.perf_counter() - step_start
            state.tokens += tokens
            run_tokens, run_seconds = run_tokens + tokens, run_seconds + seconds
            window["loss"] += step_loss.item()
            window["steps"] += 1
            window["tokens"] += tokens
            window["seconds"] += seconds
            bar.update()

            if state.step % opt.log_every == 0 or state.step == max_steps:
                correct = accelerator.reduce(window["correct"], "sum")
                count = accelerator.reduce(window["count"], "sum")
                record = {"step": state.step, "loss": window["loss"] / window["steps"],
                          "train_acc": (correct / count.clamp(min=1)).tolist(),
                          "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                          "tokens_per_s": window["tokens"] / window["seconds"], "tokens": state.tokens}
                metrics_log.log(record)
                history.append(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['train_acc'][0]:.3f}")
                logger.info("step %d/%d | loss %.4f | train acc_k %s | lr %.2e | %.0f tok/s", state.step, max_steps,
                            record["loss"], " ".join(f"{a:.3f}" for a in record["train_acc"]), record["lr"],
                            record["tokens_per_s"])
                window = {"loss": 0.0, "steps": 0, "tokens": 0, "correct": 0, "count": 0, "seconds": 0.0}
            if eval_loader is not None and opt.eval_every and state.step % opt.eval_every == 0:
                history.append(_eval_and_keep_best(accelerator, head, target, eval_loader, cfg, depth, state,
                                                   metrics_log))
            if opt.save_every and state.step % opt.save_every == 0:
                save_checkpoint(accelerator, output_dir, state, head, optimizer, scheduler, opt.keep_last_checkpoints)
    return history, run_tokens / max(run_seconds, 1e-9)


def _eval_and_keep_best(accelerator, head, target, loader, cfg, depth, state: TrainState, metrics_log) -> dict:
    """Evaluate, log, and save the head to output_dir/best when simulated τ improved."""
    metrics = evaluate(accelerator, head, target, loader, cfg, depth)
    record = {"step": state.step, **metrics}
    metrics_log.log(record)
    logger.info("eval step %d | %s | draft-vocab coverage %.3f", state.step, format_acceptance(metrics),
                metrics["draft_vocab_coverage"])
    if metrics["tau"] > state.best_tau:
        state.best_tau, state.best_step = metrics["tau"], state.step
        if accelerator.is_main_process:
            head.save_pretrained(Path(cfg.output_dir) / BEST)
            (Path(cfg.output_dir) / BEST / "eval.json").write_text(json.dumps(record, indent=1))
    return record


def _weight_norm(module: nn.Module) -> float:
    """Total L2 norm of the trainable weights (note: a host-device sync)."""
    norms = [p.detach().float().norm() for p in module.parameters() if p.requires_grad]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _micro_batches(accelerator: Accelerator, loader: DataLoader, state: TrainState) -> Iterator[dict]:
    """Micro-batches forever, epoch after epoch, starting at ``state``'s data position (resume).

    ``state.epoch``/``state.batch`` always point at the next micro-batch to be consumed.
    """
    while True:
        loader.set_epoch(state.epoch)  # the shuffle order is a function of (seed, epoch)
        batches = accelerator.skip_first_batches(loader, state.batch) if state.batch else loader
        for batch in batches:
            state.batch += 1
            yield batch
        state.epoch, state.batch = state.epoch + 1, 0


def _noise_seed(seed: int, step: int, micro: int, rank: int) -> int:
    return (((seed * 1_000_003 + step) * 4099 + micro) * 1031 + rank) % (2**63)


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config -> flat scalar dict for the trackers' hyper-parameter tables."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def run_card(head: nn.Module, output_dir: Path, data_summary, final: dict, state: TrainState, vocab) -> str:
    """README.md: ``heads.card`` (target, inputs, training record, usage) plus this run's data and results."""
    from heads.card import model_card, training_info

    lines = ["## This run", ""]
    if final:
        lines.append(f"- this directory holds the **final** head: simulated τ {final['tau']:.3f} at step {state.step} "
                     f"(acc_k {', '.join(f'{a:.3f}' for a in final['acc'])})")
        lines.append(f"- the best head by simulated τ ({state.best_tau:.3f}, step {state.best_step}) is in `{BEST}/`")
    lines.append(f"- {state.step} optimizer steps, {state.tokens} training tokens")
    if vocab is not None:
        lines.append(f"- draft vocabulary: {head.config.draft_vocab_size} most frequent training targets, covering "
                     f"{100 * vocab.coverage:.1f}% of them")
    summary = [line for line in str(data_summary).splitlines() if not line.startswith("cache ")]  # a local path
    lines += ["- training data:", "", "```", *summary, "```", ""]
    return model_card(head, training=training_info(output_dir)) + "\n" + "\n".join(lines)


# ---------------------------------------------------------------- throughput (scripts/benchmark.py)


def measure_throughput(cfg: TrainConfig, *, steps: int = 10, warmup: int = 3) -> dict:
    """Training tokens/s of ``cfg``'s head (target forward + head forward/backward + optimizer step)
    and the target's forward-only tokens/s (with logits), on the same batches, in this process.

    Uses ``cfg``'s target, data, micro-batch size and precision; nothing is written to disk except the
    data caches. Returns ``{"train_tokens_per_s", "target_forward_tokens_per_s", "ratio", ...}``.
    """
    target_path = resolve_target(cfg.target)
    accelerator = Accelerator(mixed_precision=cfg.train.mixed_precision)
    run = prepare_run(accelerator, cfg, target_path)
    loader = DataLoader(run.train_set, batch_size=cfg.train.micro_batch_size,
                        collate_fn=lambda rows: collate(rows, run.pad_id))
    batches = [b for _, b in zip(range(warmup + steps), _cycle(loader))]
    batches = [{k: v.to(accelerator.device) for k, v in b.items()} for b in batches]
    objective = Objective(run.head, cfg)
    optimizer = torch.optim.AdamW(run.head.parameters(), lr=cfg.train.lr, betas=cfg.train.betas)
    objective, optimizer = accelerator.prepare(objective, optimizer)
    objective.train()
    kind, head = cfg.head.kind, run.head
    lm_head = run.target.get_output_embeddings() if kind == "eagle" else None

    def train_step(batch: dict) -> None:
        features = target_features(run.target, batch, kind, aux_layer_ids=head.feature_layer_ids,
                                   t2d=getattr(head, "t2d", None))
        accelerator.backward(objective(features, lm_head).loss)
        accelerator.clip_grad_norm_(objective.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def forward_only(batch: dict) -> None:
        with accelerator.autocast():
            target_forward(run.target, batch["input_ids"], compute_logits=True)

    def tokens_per_second(fn) -> float:
        sync(accelerator.device)  # note: host-device sync so the timer sees finished work
        start = time.perf_counter()
        for batch in batches[warmup:]:
            fn(batch)
        sync(accelerator.device)
        return sum(int(b["lengths"].sum()) for b in batches[warmup:]) / (time.perf_counter() - start)

    for batch in batches[:warmup]:  # both warmed up before either is timed
        forward_only(batch)
        train_step(batch)
    forward = tokens_per_second(forward_only)
    train = tokens_per_second(train_step)
    return {"head_kind": kind, "train_tokens_per_s": train, "target_forward_tokens_per_s": forward,
            "ratio": train / forward, "micro_batch_size": cfg.train.micro_batch_size,
            "max_length": cfg.data.max_length, "device": str(accelerator.device),
            "mixed_precision": cfg.train.mixed_precision, "steps": steps}


def _cycle(loader: DataLoader) -> Iterator[dict]:
    while True:
        yield from loader


