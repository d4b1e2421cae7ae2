"""The training loop: micro-batches, one frozen-target pass and one head forward per micro-batch,
the optimizer step behind the divergence guard, logging, periodic evaluation and checkpoints."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from draftsmith.train.config import TrainConfig
from draftsmith.train.divergence import DivergenceGuard, TrainingDiverged
from draftsmith.train.evaluation import eval_and_keep_best
from draftsmith.train.feature_source import FeatureSource
from draftsmith.train.metrics_log import MetricsLog
from draftsmith.train.resume import TrainState, latest_checkpoint, save_checkpoint

logger = logging.getLogger("draftsmith.train")


def fit(accelerator: Accelerator, cfg: TrainConfig, objective: nn.Module, target: nn.Module,
        optimizer: torch.optim.Optimizer, scheduler, train_loader: DataLoader, eval_loader: DataLoader | None,
        state: TrainState, max_steps: int, depth: int, metrics_log: MetricsLog,
        source: FeatureSource | None = None) -> tuple[list[dict], float]:
    """The training loop; returns the logged records and the training tokens/s (all processes).
    ``source``: where each batch's target hidden states come from (default: the target, online)."""
    opt = cfg.train
    head = accelerator.unwrap_model(objective).head
    source = source or FeatureSource()
    output_dir = Path(cfg.output_dir)
    micro_batches = _micro_batches(accelerator, train_loader, state)
    next_batch = lambda: next(micro_batches)  # noqa: E731
    history: list[dict] = []
    window = _window()
    run_tokens, run_seconds = 0, 0.0  # training steps only: evaluation and checkpoints excluded
    guard = DivergenceGuard(check_grad=opt.mixed_precision != "fp16")
    guard.load_state_dict(state.guard)
    objective.train()
    # disable=None: no bar when stderr is not a terminal (log files get the log lines, not bar frames)
    bar = tqdm(total=max_steps, initial=state.step, desc=f"train {cfg.head.kind}",
               disable=None if accelerator.is_main_process else True)
    time_up = _clock(accelerator, opt.max_minutes)
    with bar, logging_redirect_tqdm():  # the bar is closed before any error is printed
        while state.step < max_steps and not time_up():
            step_start = time.perf_counter()
            accelerator.unwrap_model(objective).at_step(state.step, max_steps)
            step_loss, tokens = _accumulate(accelerator, cfg, objective, target, source, next_batch, state.step,
                                            window)
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
                record = _record(accelerator, window, state, scheduler.get_last_lr()[0], float(grad_norm))
                metrics_log.log(record)
                history.append(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['train_acc'][0]:.3f}")
                _log_line(record, max_steps)
                window = _window()
            if eval_loader is not None and opt.eval_every and state.step % opt.eval_every == 0:
                history.append(eval_and_keep_best(accelerator, head, target, eval_loader, cfg, depth, state,
                                                   metrics_log))
            if opt.save_every and state.step % opt.save_every == 0:
                save_checkpoint(accelerator, output_dir, state, head, optimizer, scheduler, opt.keep_last_checkpoints,
                                backbone=accelerator.unwrap_model(objective).backbone)
    return history, run_tokens / max(run_seconds, 1e-9)


def _accumulate(accelerator: Accelerator, cfg: TrainConfig, objective: nn.Module, target: nn.Module,
                source: FeatureSource, next_batch, step: int, window: dict) -> tuple[torch.Tensor, int]:
    """One optimizer step's micro-batches: features (from ``source``), perturbed (and rolled out on-policy), the
    loss backward (gradients synced on the last only); adds accuracy and acceptance to ``window``. Returns the
    step's mean loss (this process) and its tokens (all processes)."""
    opt = cfg.train
    head = accelerator.unwrap_model(objective).head
    lm_head = target.get_output_embeddings()  # passed to the objective, never trained
    step_loss = torch.zeros((), device=accelerator.device)
    tokens = 0
    for micro in range(opt.grad_accum_steps):
        batch = next_batch()
        features = source.features(type(accelerator.unwrap_model(objective)), target, batch, head)
        seed = _noise_seed(cfg.seed, step, micro, accelerator.process_index)
        accelerator.unwrap_model(objective).perturb(features, cfg, seed=seed)
        if opt.stage == "on-policy":  # the head drafts, the frozen target verifies (train/on_policy.py)
            accelerator.unwrap_model(objective).rollout(features, target, cfg, seed=seed)
        last = micro == opt.grad_accum_steps - 1
        with nullcontext() if last else accelerator.no_sync(objective):
            out = objective(features, lm_head)
            accelerator.backward(out.loss / opt.grad_accum_steps)
        step_loss += out.loss.detach() / opt.grad_accum_steps
        window["correct"] = window["correct"] + out.correct
        window["count"] = window["count"] + out.count
        if out.accept is not None:
            window["accept"] = window["accept"] + out.accept
        tokens += int(batch["lengths"].sum())
    return step_loss, int(accelerator.reduce(torch.tensor(tokens, device=accelerator.device), "sum"))


def _record(accelerator: Accelerator, window: dict, state: TrainState, lr: float, grad_norm: float) -> dict:
    """The log record of the steps summed in ``window`` (accuracy and acceptance over every process)."""
    correct = accelerator.reduce(window["correct"], "sum")
    count = accelerator.reduce(window["count"], "sum")
    record = {"step": state.step, "loss": window["loss"] / window["steps"],
              "train_acc": (correct / count.clamp(min=1)).tolist(), "lr": lr, "grad_norm": grad_norm,
              "tokens_per_s": window["tokens"] / window["seconds"], "tokens": state.tokens}
    if torch.is_tensor(window["accept"]):  # the exact acceptance rate sum(min(p, q)) per position
        accept = accelerator.reduce(window["accept"], "sum")
        record["train_accept"] = (accept / count.clamp(min=1)).tolist()
    return record


def _log_line(record: dict, max_steps: int) -> None:
    accept = "".join(f" {a:.3f}" for a in record.get("train_accept", []))
    logger.info("step %d/%d | loss %.4f | train acc_k %s%s | lr %.2e | %.0f tok/s", record["step"], max_steps,
                record["loss"], " ".join(f"{a:.3f}" for a in record["train_acc"]),
                f" | accept_k{accept}" if accept else "", record["lr"], record["tokens_per_s"])


def _window() -> dict:
    """What the loop sums between two log lines."""
    return {"loss": 0.0, "steps": 0, "tokens": 0, "correct": 0, "count": 0, "accept": 0, "seconds": 0.0}


def _clock(accelerator: Accelerator, minutes: float | None):
    """A function that says whether ``minutes`` have passed, the same answer on every process."""
    if minutes is None:
        return lambda: False
    deadline = time.monotonic() + 60 * minutes

    def time_up() -> bool:
        late = torch.tensor(float(time.monotonic() >= deadline), device=accelerator.device)
        return bool(accelerator.reduce(late, "max"))  # one process past the deadline stops them all

    return time_up


def _weight_norm(module: nn.Module) -> float:
    """Total L2 norm of the trainable weights (note: a host-device sync)."""
    norms = [p.detach().float().norm() for p in module.parameters() if p.requires_grad]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _micro_batches(accelerator: Accelerator, loader: DataLoader, state: TrainState) -> Iterator[dict]:
    """Micro-batches forever, epoch after epoch, starting at ``state``'s data position (resume).

    ``state.epoch``/``state.batch`` always point at the next micro-batch to be consumed.
    """
    if state.batch > len(loader):  # a resumed position past the epoch would silently skip it whole
        raise ValueError(f"the resumed data position batch={state.batch} is outside [0, {len(loader)}], the "
                         "micro-batches of one epoch of this data in this process; resume with the data and "
                         "processes it was saved with")
    while True:
        loader.set_epoch(state.epoch)  # the shuffle order is a function of (seed, epoch)
        batches = accelerator.skip_first_batches(loader, state.batch) if state.batch else loader
        for batch in batches:
            state.batch += 1
            yield batch
        state.epoch, state.batch = state.epoch + 1, 0


def _noise_seed(seed: int, step: int, micro: int, rank: int) -> int:
    return (((seed * 1_000_003 + step) * 4099 + micro) * 1031 + rank) % (2**63)
