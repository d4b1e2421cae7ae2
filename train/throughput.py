"""Training throughput of a config against the target's forward-only throughput (scripts/benchmark.py)."""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from draftsmith.data.base.device import sync
from draftsmith.data.targets import resolve_target
from draftsmith.target.model import target_forward
from draftsmith.train.config import TrainConfig
from draftsmith.train.examples import collate
from draftsmith.train.run import prepare_run
from draftsmith.train.objectives import objective_class


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
    objective_cls = objective_class(cfg.head.kind, cfg.head.variant)
    objective = objective_cls(run.head, cfg)
    objective.attach_backbone(run.target)  # Medusa-2: the adapters train too
    optimizer = torch.optim.AdamW(objective.param_groups(), lr=cfg.train.lr, betas=cfg.train.betas)
    objective, optimizer = accelerator.prepare(objective, optimizer)
    objective.train()
    lm_head = run.target.get_output_embeddings()

    def train_step(batch: dict) -> None:
        features = objective_cls.features(run.target, batch, run.head)
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
    return {"head_kind": cfg.head.kind, "train_tokens_per_s": train, "target_forward_tokens_per_s": forward,
            "ratio": train / forward, "micro_batch_size": cfg.train.micro_batch_size,
            "max_length": cfg.data.max_length, "device": str(accelerator.device),
            "mixed_precision": cfg.train.mixed_precision, "steps": steps}


def _cycle(loader: DataLoader) -> Iterator[dict]:
    while True:
        yield from loader
