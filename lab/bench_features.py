"""What one micro-batch's ``Features`` cost: the target's forward (online) against stored features.

    python lab/bench_features.py --config configs/demo.yaml --stores DIR [DIR ...] [--batches 60] [key=value ...]

Each store is a ``scripts/dump_features.py`` folder for the same config. The same random micro-batches
(``train.micro_batch_size`` rows) go through every source in turn, so a busy machine slows them alike;
the median and mean milliseconds per micro-batch are printed. Both paths include what is rebuilt from the
states (logits from the lm_head, embeddings); the difference is the target's decoder layers against the read.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from draftsmith.data.base.checks import cli_count
from draftsmith.data.entry_point import run
from draftsmith.data.targets import resolve_target
from draftsmith.target.threads import choose_threads
from draftsmith.train.config import load_config
from draftsmith.train.examples import IndexedRows, collate
from draftsmith.train.feature_source import FeatureSource
from draftsmith.train.run import prepare_run
from draftsmith.train.objectives import objective_class


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="the training run's YAML config")
    p.add_argument("--stores", nargs="+", type=Path, required=True, help="dump_features folders for this config")
    p.add_argument("--batches", type=cli_count(), default=60, help="micro-batches per source (default 60)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = p.parse_intermixed_args(argv)
    from accelerate import Accelerator

    cfg = load_config(args.config, args.overrides)
    accelerator = Accelerator()
    print(choose_threads(), file=sys.stderr)
    built = prepare_run(accelerator, cfg, resolve_target(cfg.target))
    objective = objective_class(cfg.head.kind, cfg.head.variant)
    aux_ids = objective.aux_layer_ids(built.head)
    sources = {"online": FeatureSource()}
    for path in args.stores:
        stored = load_config(args.config, [*args.overrides, f"data.features={path}"])
        sources[str(path)] = FeatureSource.for_run(accelerator, stored, built.target, built.tokenizer, aux_ids,
                                                   len(built.train_set))
    rows = IndexedRows(built.train_set)
    size = cfg.train.micro_batch_size
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    seconds: dict[str, list[float]] = {name: [] for name in sources}
    tokens = 0
    for b in range(args.batches):
        batch = collate([rows[order[(b * size + i) % len(rows)]] for i in range(size)], built.pad_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        tokens += int(batch["lengths"].sum())
        for name, source in sources.items():
            start = time.perf_counter()
            source.features(objective, built.target, batch, built.head)
            if accelerator.device.type == "cuda":
                torch.cuda.synchronize()  # note: a host-device sync, so the time covers the work
            seconds[name].append(time.perf_counter() - start)
    print(f"{args.batches} micro-batches of {size} rows ({tokens / args.batches:.0f} tokens each), {cfg.head.kind}:")
    for name, values in seconds.items():
        values = sorted(values)
        print(f"  {name}: median {1e3 * values[len(values) // 2]:.1f} ms, mean {1e3 * sum(values) / len(values):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
