"""What a training config costs before launch: per-GPU memory, feature disk, tokens and time per step.

    draftsmith cost --config F [key=value ...] --gpus N [--nodes M] [--gpu-memory-gib 80]
        [--tokens-per-s T] [--rows R] [--feature-dtype bfloat16] [--measure]

Per GPU: the frozen target (whole, or its FSDP shard with ``train.target_sharding=fsdp``), the head
with its gradients and AdamW state, and the activations of one micro-batch at ``data.max_length``,
each printed with its arithmetic; when the total exceeds ``--gpu-memory-gib``, which setting to
change. ``--tokens-per-s`` (training tokens/s of one process on the same hardware) gives the step
time; ``--rows`` the disk of offline features. ``--measure`` also trains a few steps here and prints
the measured peak next to the plan for this launch's processes: one with ``python``, each of N under
``accelerate launch --num_processes N scripts/cost.py ...`` (docs/scaling.md). For a hybrid target
(Gated DeltaNet, Mamba, short-conv layers) it also prints what decoding keeps per sequence: the recurrent
and conv states and the checkpoint of them speculative decoding takes each step (docs/hybrid-demo.md). The
target is read from its local config.json or a built-in table of Hub shapes: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import sys

from draftsmith.data.base.checks import cli_count, cli_real
from draftsmith.data.base.names import FEATURE_DTYPES
from draftsmith.data.entry_point import prog, run
from draftsmith.train.config import load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog("cost.py"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="training YAML (as train/train_head.py takes it)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--gpus", type=cli_count(), required=True, help="GPUs (training processes) per node")
    p.add_argument("--nodes", type=cli_count(), default=1, help="nodes (default 1)")
    p.add_argument("--gpu-memory-gib", type=cli_real(0, above=True), default=80.0, help="memory of one GPU in GiB (default 80)")
    p.add_argument("--tokens-per-s", type=cli_real(0, above=True), help="measured training tokens/s of one process")
    p.add_argument("--rows", type=cli_count(), help="training rows, for the disk of offline features")
    p.add_argument("--feature-dtype", default="bfloat16", choices=FEATURE_DTYPES,
                   help="dtype of offline features (scripts/dump_features.py --dtype; default bfloat16)")
    p.add_argument("--measure", action="store_true", help="also train a few steps here and compare the peak")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    # torch and transformers load only now: a mistake in the arguments or most config keys is one line first
    from draftsmith.target.recurrent import check_supported
    from draftsmith.train.cost import GIB, format_plan, make_plan, measure_peak, target_config

    config = target_config(cfg.target)
    check_supported(config)  # a Mamba, RWKV, ... target: one line (its config has no attention shape to plan)
    plan = make_plan(cfg, config, args.gpus, args.nodes, gpu_memory_gib=args.gpu_memory_gib,
                     tokens_per_s=args.tokens_per_s, rows=args.rows, feature_dtype=args.feature_dtype)
    print(format_plan(cfg, plan, args.gpus, args.nodes), flush=True)
    if args.measure:  # under `accelerate launch --num_processes N` every process measures its own peak
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        here = make_plan(cfg, config, world, 1)
        measured = measure_peak(cfg)
        print(f"\nmeasured here, process {rank} of {world}: peak {measured['peak_bytes'] / GIB:.3f} GiB "
              f"({measured['what']}) vs planned {here.total / GIB:.3f} GiB for {world} process(es) "
              f"({', '.join(f'{k} {v / GIB:.3f}' for k, v in here.parts.items())}): "
              f"planned/measured = {here.total / measured['peak_bytes']:.2f}; "
              f"training {measured['train_tokens_per_s']:.0f} tokens/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
