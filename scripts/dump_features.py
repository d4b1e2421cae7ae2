"""Store the frozen target's hidden states for a training config once, then train from them (issue 19).

    draftsmith dump-features --config configs/demo.yaml --out features/demo-eagle3 [--dtype fp8]
    accelerate launch train/train_head.py --config configs/demo.yaml data.features=features/demo-eagle3

``--config`` and ``key=value`` overrides are the training run's (``train/train_head.py --help``): the
target, ``head.kind`` (with its aux layers) and ``data.train`` / ``data.max_length`` decide what is
stored, in ``data.train``'s row order: ids, loss masks, the final post-norm hidden state and, for
eagle3/dflash, the aux layers' states. ``--dtype`` defaults to the target's own (lossless); ``fp8`` keeps
float8_e4m3fn values with one float32 scale per token. The disk estimate is printed before the target
runs. A killed dump continues where it stopped when run again with the same ``--out``: written shards are
kept, the cut-off one is written again, so every row is stored exactly once. A folder made for another
target or config, or holding other files, is refused. One process (rank 0's work only): launch it with
``python``, not ``accelerate launch`` with several processes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_real
from draftsmith.data.base.names import FEATURE_DTYPES
from draftsmith.data.entry_point import prog, run
from draftsmith.train.config import load_config
from draftsmith.train.train_head import DEMO_CONFIG


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog("dump_features.py"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEMO_CONFIG),
                   help="the training run's YAML config (default, as train/train_head.py's: %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="feature folder (absent, empty, or an earlier dump's)")
    p.add_argument("--dtype", choices=FEATURE_DTYPES, help="storage precision (default: the target's own)")
    p.add_argument("--shard-mb", type=cli_real(0, above=True), default=512, help="write a shard every this many MB (default 512)")
    p.add_argument("--batch-size", type=cli_count(), help="rows per target forward (default: train.micro_batch_size)")
    p.add_argument("--device", help="default: cuda when present, else cpu")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. head.kind=eagle")
    args = p.parse_intermixed_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("dump_features runs as one process: start it with python, not accelerate launch with "
                         f"{os.environ['WORLD_SIZE']} processes")
    cfg = load_config(args.config, args.overrides)
    # torch and transformers load only now: a mistake in the arguments or most config keys is one line first
    import torch

    from draftsmith.data.base.device import default_device
    from draftsmith.data.base.progress import progress
    from draftsmith.data.feature_store import bytes_per_token, open_store
    from draftsmith.data.targets import resolve_target
    from draftsmith.heads import build_head
    from draftsmith.target.model import target_forward
    from draftsmith.target.threads import choose_threads
    from draftsmith.train.examples import collate, data_sources, load_examples
    from draftsmith.train.feature_source import feature_fingerprint, row_states
    from draftsmith.train.objectives import objective_class
    from draftsmith.train.run import load_frozen_target

    device = default_device(args.device)
    if device.type == "cpu":  # as training: one thread was 10-50x faster than two on a busy machine
        print(f"dump_features: {choose_threads()}", file=sys.stderr, flush=True)
    tokenizer, target, identity = load_frozen_target(cfg, resolve_target(cfg.target), device)
    train_source, _ = data_sources(cfg, target, tokenizer)  # the rows training reads (data.self_distill too)
    train_set, _ = load_examples(train_source, tokenizer, cfg, identity["vocab_size"], "data.train")
    head = build_head(cfg.head.kind, target, **cfg.head.build_options())  # only for its aux layer ids
    aux_ids = objective_class(cfg.head.kind, cfg.head.variant).aux_layer_ids(head)
    del head
    fingerprint = feature_fingerprint(cfg, target, tokenizer, aux_ids, len(train_set))
    dtype = args.dtype or fingerprint["target.dtype"]
    store = open_store(args.out, fingerprint, key="--out", dtype=dtype, create=True, writer="dump",
                       shard_bytes=int(args.shard_mb * (1 << 20)))

    lengths = [len(ids) for ids in train_set["input_ids"]]
    todo = [r for r in range(len(train_set)) if r not in store.index]
    widths = {"final": identity["hidden_size"], **({"aux": len(aux_ids) * identity["hidden_size"]} if aux_ids else {})}
    estimate = sum(lengths) * bytes_per_token(widths, dtype)
    print(f"dump_features: {len(train_set)} rows, {sum(lengths)} tokens of {cfg.data.train} -> {args.out} as {dtype} "
          f"({', '.join(f'{k} {w}' for k, w in widths.items())} per token): about {estimate / 1e9:.3f} GB; "
          f"{len(train_set) - len(todo)} rows already stored", file=sys.stderr, flush=True)
    start = time.monotonic()
    batch_size = args.batch_size or cfg.train.micro_batch_size
    bar = progress(len(todo), "dump_features")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    try:
        for first in range(0, len(todo), batch_size):
            rows = todo[first: first + batch_size]
            batch = collate([train_set[r] for r in rows], pad_id)
            with torch.no_grad():
                out = target_forward(target, batch["input_ids"].to(device), aux_layer_ids=aux_ids,
                                     compute_logits=False)
            for i, (row, length) in enumerate(zip(rows, batch["lengths"].tolist())):
                store.add(row, batch["input_ids"][i, :length], batch["loss_mask"][i, :length],
                          row_states(out, i, length))
            bar.update(len(rows))
        store.flush()
    finally:
        bar.close()
    size = store.disk_bytes()
    print(f"dump_features: {len(store)} rows in {len(store.known)} shards, {size / 1e9:.3f} GB on disk "
          f"(estimate {estimate / 1e9:.3f} GB) in {time.monotonic() - start:.0f} s. Train with "
          f"data.features={args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
