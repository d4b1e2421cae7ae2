"""Held-out evaluation during training: acceptance per draft step and simulated τ, decode τ (the head
decoding held-out prompts as the generator does, ``train.decode_tau``), and keeping the best head so far
in ``output_dir/best`` (by ``train.best_by``)."""
from __future__ import annotations

import json
import logging
import time
import weakref
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from draftsmith.train.checkpoint import BEST
from draftsmith.train.config import TrainConfig
from draftsmith.infer.seeded_decode import interval_sums, tau_interval
from draftsmith.train.decode_tau import (DecodeSet, head_drafter, greedy_continuations, not_decodable, row_counts,
                                        with_features)
from draftsmith.train.sampled_decode import sampled_row_counts
from draftsmith.train.settings import decode_tau_key
from draftsmith.train.draft_temperature import DraftTemperatureFit
from draftsmith.train.metrics import AcceptanceMeter, format_acceptance, step_correctness
from draftsmith.train.objectives import objective_class
from draftsmith.train.resume import TrainState
from draftsmith.train.target_sharding import pad_target_passes, passes_short

logger = logging.getLogger("draftsmith.train")


@torch.no_grad()
def evaluate(accelerator: Accelerator, head: nn.Module, target: nn.Module, loader: DataLoader, cfg: TrainConfig,
             depth: int) -> dict:
    """acc_k, cond_acc_k and simulated τ of ``head`` on this process's share of the held-out data,
    summed over processes; plus the share of target top-1 tokens the draft vocab covers and, where the features
    carry it, the mean share of the target's law inside it (``draft_vocab_mass``: the most a draft sampled at
    T = 1 survives with, whatever the head learns; ``DraftTargets.mass``). Where the kind has one
    (``fit_draft_temperature``), the draft temperature per depth fitted on the same positions
    (``train/draft_temperature.py``), set in the head's config (its decode τ and its saves read it), with the
    sampled survival chance per depth at it and untempered (``sampled_accept``, ``sampled_accept_untempered``)."""
    was_training = head.training
    head.eval()
    meter = AcceptanceMeter(depth, accelerator.device)
    fit, fitted = DraftTemperatureFit(depth, accelerator.device), False
    covered = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # [in draft vocab, masked, law mass]
    has_mass = True
    lm_head = target.get_output_embeddings()
    t2d = getattr(head, "t2d", None)
    objective = objective_class(cfg.head.kind, cfg.head.variant)
    short = passes_short(accelerator, target, len(loader))  # held-out shards may differ by a batch
    for batch in loader:
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.autocast():
            features = objective.features(target, batch, head, need_top1=True)
            drafted = objective.draft_top1(head, features, depth, lm_head)
            fitted = objective.fit_draft_temperature(head, features, depth, fit) or fitted
        meter.update(*step_correctness(drafted, features.top1, features.loss_mask))
        masked = features.loss_mask[:, 1:].bool()  # target top-1 at j predicts token j+1
        in_vocab = t2d[features.top1[:, :-1]] if t2d is not None else torch.ones_like(masked)
        targets = getattr(features, "targets", None)
        mass = getattr(targets, "mass", None)
        has_mass = has_mass and mass is not None
        law = (mass[:, :-1] * masked).sum() if mass is not None else masked.new_zeros((), dtype=torch.float32)
        covered += torch.stack([(in_vocab & masked).sum().double(), masked.sum().double(), law.double()])
    pad_target_passes(target, short)
    meter.state = accelerator.reduce(meter.state, reduction="sum")
    covered = accelerator.reduce(covered, reduction="sum")
    fit.state = accelerator.reduce(fit.state, reduction="sum")
    head.train(was_training)
    metrics = meter.compute()
    if fitted:  # every process fits (the same sums), so every process's drafter reads the same temperatures
        metrics["draft_temperature"] = fit.best()
        metrics["sampled_accept"] = fit.rates(metrics["draft_temperature"])
        metrics["sampled_accept_untempered"] = fit.rates([1.0] * depth)
        head.config.draft_temperature = metrics["draft_temperature"]
    metrics["draft_vocab_coverage"] = (covered[0] / covered[1].clamp(min=1)).item()
    if has_mass:
        metrics["draft_vocab_mass"] = (covered[2] / covered[1].clamp(min=1)).item()
    return metrics


# eval loader -> its decode set, made at the run's first evaluation (None: decode τ is not computed)
_DECODE_SETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decode_prompts(dataset, rows: int, prompt_tokens: int, longest: int | None = None) -> list[torch.Tensor]:
    """(1, P) prompts of the first ``rows`` held-out rows that go on after them (and are at most ``longest``
    tokens): a row's tokens before its first trained token (a conversation's turns before the first answer),
    or its first ``prompt_tokens`` where that would leave BOS alone (plain text: every token after BOS is
    trained)."""
    prompts = []
    for row in dataset:
        if len(prompts) == rows:
            break
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        first = mask.index(1) if 1 in mask else len(ids)
        length = first if first > 1 else prompt_tokens
        if 0 < length < len(ids) and (longest is None or length <= longest):
            prompts.append(torch.tensor(ids[:length], dtype=torch.long)[None])
    return prompts


def _skip_reason(accelerator: Accelerator, cfg: TrainConfig, drafter) -> str | None:
    """Why decode τ is not computed for this run (None: it is)."""
    if cfg.train.backbone_lora_rank:
        return "the target trains with the head (train.backbone_lora_rank): its greedy text is not fixed"
    if cfg.train.target_sharding == "fsdp" and accelerator.num_processes > 1:
        return "the target is sharded (train.target_sharding=fsdp)"
    return not_decodable(drafter)


def decode_set_for(accelerator: Accelerator, head: nn.Module, target: nn.Module, loader: DataLoader,
                   cfg: TrainConfig) -> DecodeSet | None:
    """This process's share of the ``train.eval_decode_rows`` held-out prompts with the target's greedy
    continuations and features, made once per run (None: not computed, said once in the log)."""
    if loader in _DECODE_SETS:
        return _DECODE_SETS[loader]
    opt = cfg.train
    for key in ("eval_decode_rows", "eval_decode_tokens"):
        if getattr(opt, key) < 0:
            raise ValueError(f"train.{key} must be >= 0, got {getattr(opt, key)}")
    decode_set, why = None, None
    if opt.eval_decode_rows and opt.eval_decode_tokens:
        drafter = head_drafter(head, target)
        why = _skip_reason(accelerator, cfg, drafter)
        if why is None:  # this process's share of the prompts
            n, rank = accelerator.num_processes, accelerator.process_index
            share = opt.eval_decode_rows // n + (rank < opt.eval_decode_rows % n)
            room = getattr(target.config, "max_position_embeddings", None)  # prompt + new tokens must fit
            longest = None if room is None else room - opt.eval_decode_tokens
            prompts = [p.to(accelerator.device) for p in
                       decode_prompts(loader.dataset, share, cfg.data.self_distill.prompt_tokens, longest)]
            if not prompts:  # the set stays (empty): every process takes part in the sums
                logger.warning("decode tau: no held-out row of %s goes on after its prompt within the target's %s "
                               "positions less train.eval_decode_tokens=%d", cfg.data.eval, room,
                               opt.eval_decode_tokens)
            rows = greedy_continuations(target, prompts, opt.eval_decode_tokens)
            with_features(target, rows, tuple(drafter.aux_layer_ids))
            decode_set = DecodeSet(rows, opt.eval_decode_tokens)
            logger.info("decode tau: %d held-out prompt(s) x %d new tokens, drafted by %s", len(rows),
                        opt.eval_decode_tokens, type(drafter).__name__)
        else:
            logger.info("decode tau is not computed for head kind %s: %s", cfg.head.kind, why)
    if opt.best_by.startswith("decode_tau") and decode_set is None:
        raise ValueError(f"train.best_by={opt.best_by}, but decode tau is not computed: "
                         f"{why or 'train.eval_decode_rows or train.eval_decode_tokens is 0'}")
    _DECODE_SETS[loader] = decode_set
    return decode_set


def decode_at(accelerator: Accelerator, head: nn.Module, target: nn.Module, decode_set: DecodeSet,
              temperature: float) -> dict:
    """Decode τ at ``temperature`` (0: the greedy replay; > 0: the generator, seeded per prompt) over every
    process's prompts, its 95% interval over the prompts, its counts and seconds, under ``decode_tau_key``'s
    names; empty when no process had a prompt. Every process's sums are added before anything is divided."""
    started = time.perf_counter()
    was_training = head.training
    head.eval()
    try:
        with accelerator.autocast():
            counts = (row_counts(head_drafter(head, target), decode_set) if temperature == 0 else
                      sampled_row_counts(head, target, decode_set, temperature))
    finally:
        head.train(was_training)
    sums = accelerator.reduce(torch.tensor(interval_sums(counts), dtype=torch.float64, device=accelerator.device),
                              reduction="sum").tolist()
    if not sums[1]:  # no prompt anywhere (said when the set was made)
        return {}
    tau, low, high = tau_interval(sums)
    key = decode_tau_key(temperature)
    out = {key: tau, decode_tau_key(temperature, "decode_steps"): int(sums[1]),
           decode_tau_key(temperature, "decode_tokens"): int(sums[2]),
           decode_tau_key(temperature, "decode_seconds"): time.perf_counter() - started}
    if low is not None:
        out.update({f"{key}_low": low, f"{key}_high": high})
    return out


def evaluate_decoding(accelerator: Accelerator, head: nn.Module, target: nn.Module, loader: DataLoader,
                      cfg: TrainConfig) -> dict:
    """Decode τ at every ``train.eval_temperature`` (``decode_at``); empty when decode τ is not computed for this
    run."""
    decode_set = decode_set_for(accelerator, head, target, loader, cfg)
    if decode_set is None:
        return {}
    metrics = {}
    for temperature in cfg.train.eval_temperature:
        metrics.update(decode_at(accelerator, head, target, decode_set, temperature))
    return metrics


def best_metric(cfg: TrainConfig, metrics: dict) -> str:
    """The record key ``output_dir/best`` is chosen by: ``train.best_by``; auto = decode τ at the first
    ``train.eval_temperature`` where it is computed, else simulated τ."""
    by = cfg.train.best_by
    if by == "simulated_tau":
        return "tau"
    if by == "auto":
        return next((k for k in map(decode_tau_key, cfg.train.eval_temperature) if k in metrics), "tau")
    if by not in metrics:
        raise ValueError(f"train.best_by={by}, but no held-out prompt was decoded (see the log)")
    return by


def eval_and_keep_best(accelerator, head, target, loader, cfg, depth, state: TrainState, metrics_log) -> dict:
    """Evaluate, log, and save the head to output_dir/best when its ``best_metric`` improved."""
    metrics = evaluate(accelerator, head, target, loader, cfg, depth)
    metrics.update(evaluate_decoding(accelerator, head, target, loader, cfg))
    record = {"step": state.step, **metrics, "best_by": best_metric(cfg, metrics)}
    metrics_log.log(record)
    mass = f", law mass {metrics['draft_vocab_mass']:.3f}" if "draft_vocab_mass" in metrics else ""
    logger.info("eval step %d | %s | draft-vocab coverage %.3f%s", state.step, format_acceptance(metrics),
                metrics["draft_vocab_coverage"], mass)
    score = metrics[record["best_by"]]
    if score > state.best_tau:
        state.best_tau, state.best_step = score, state.step
        if accelerator.is_main_process:
            head.save_pretrained(Path(cfg.output_dir) / BEST)
            (Path(cfg.output_dir) / BEST / "eval.json").write_text(json.dumps(record, indent=1))
    return record
