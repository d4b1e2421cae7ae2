"""Held-out evaluation during training: acceptance per draft step and simulated τ, and keeping the
best head so far in ``output_dir/best``."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from draftsmith.train.checkpoint import BEST
from draftsmith.train.config import TrainConfig
from draftsmith.train.metrics import AcceptanceMeter, format_acceptance, step_correctness
from draftsmith.train.objectives import objective_class
from draftsmith.train.resume import TrainState
from draftsmith.train.target_sharding import pad_target_passes, passes_short

logger = logging.getLogger("draftsmith.train")


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
    objective = objective_class(cfg.head.kind)
    short = passes_short(accelerator, target, len(loader))  # held-out shards may differ by a batch
    for batch in loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.autocast():
            features = objective.features(target, batch, head, need_top1=True)
            drafted = objective.draft_top1(head, features, depth, lm_head)
        meter.update(*step_correctness(drafted, features.top1, features.loss_mask))
        masked = features.loss_mask[:, 1:].bool()  # target top-1 at j predicts token j+1
        in_vocab = t2d[features.top1[:, :-1]] if t2d is not None else torch.ones_like(masked)
        covered += torch.stack([(in_vocab & masked).sum(), masked.sum()]).to(covered)
    pad_target_passes(target, short)
    meter.state = accelerator.reduce(meter.state, reduction="sum")
    covered = accelerator.reduce(covered, reduction="sum")
    head.train(was_training)
    metrics = meter.compute()
    metrics["draft_vocab_coverage"] = (covered[0] / covered[1].clamp(min=1)).item()
    return metrics


def eval_and_keep_best(accelerator, head, target, loader, cfg, depth, state: TrainState, metrics_log) -> dict:
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
