"""``draftsmith COMMAND [ARGS...]``: one console entry point for every draftsmith command.

    draftsmith train [--config FILE] [key=value ...]   # one process; several: accelerate launch train/train_head.py
    draftsmith launch --num_processes 2 --multi_gpu [--config FILE] [key=value ...]  # that launch, exit code 2 on a mistake
    draftsmith generate --head DIR --prompt "..." --compare
    draftsmith export --head DIR --to vllm --out DIR
    draftsmith stitch EXPORT_OR_HEAD TARGET_DIR OUT_DIR  # scripts/stitch.py (MTP heads)
    draftsmith check-export DIR --head H --target T    # scripts/check_export.py
    draftsmith check-target TARGET                     # scripts/check_target.py
    draftsmith bench --target DIR --heads DIR ...      # scripts/benchmark.py
    draftsmith bench-scale --shape llama3.1-8b         # scripts/bench_scale.py
    draftsmith regenerate --target T --data D --out OUT.jsonl
    draftsmith push --head DIR --repo-id USER/NAME
    draftsmith make-demo --size tiny
    draftsmith draft-calibration --target DIR --heads DIR  # scripts/draft_calibration.py
    draftsmith cost --config F --gpus 8                # scripts/cost.py
    draftsmith drift --head DIR --target NEW           # scripts/drift.py
    draftsmith speculation-plan --target DIR --head DIR  # scripts/speculation_plan.py
    draftsmith dump-features --config F --out DIR      # scripts/dump_features.py

``draftsmith COMMAND --help`` shows that command's options. The commands are the existing entry points
(the table below), which keep working on their own; user mistakes end in one line and exit code 2. A command's
file is named as the command (``draftsmith cost`` runs ``scripts/cost.py``; ``generate`` runs
``infer/generate_command.py``, ``train`` ``train/train_head.py``); a renamed command's old name is one line naming
the new one (``RENAMED``). Our own measurement harnesses are no commands: they run from a clone (``lab/``).
"""
from __future__ import annotations

import importlib
import sys

# command -> (module, function, how): "cli" functions return an exit code and print their own
# one-line errors; "main" functions take argv and go through data.entry_point.run for that.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("draftsmith.train.train_head", "cli", "train a draft head (configs/demo.yaml by default)"),
    "launch": ("draftsmith.scripts.launch", "cli", "accelerate launch of the training (several processes), ending with its own exit code"),
    "generate": ("draftsmith.infer.generate_command", "cli", "speculative generation with a head or a classic drafter"),
    "export": ("draftsmith.scripts.export", "cli", "export a head for vLLM, SGLang, TensorRT-LLM or TGI"),
    "stitch": ("draftsmith.scripts.stitch", "cli", "a copy of a target's folder with an MTP head's tensors in its own names"),
    "check-export": ("draftsmith.scripts.check_export", "cli", "an export run by its consumer's own code drafts what the head does"),
    "check-target": ("draftsmith.scripts.check_target", "cli",
                     "whether speculative decoding can be exact on a target (its verify against its one-token decode)"),
    "bench": ("draftsmith.scripts.benchmark", "main", "every decoding method on one target, against the bound"),
    "bench-scale": ("draftsmith.scripts.bench_scale", "main", "decoding speed at real model shapes (random weights)"),
    "regenerate": ("draftsmith.scripts.regenerate", "main", "self-distilled training data: the target rewrites the answers"),
    "push": ("draftsmith.scripts.push_to_hub", "cli", "publish a head (or an engine export) on the Hugging Face Hub"),
    "make-demo": ("draftsmith.scripts.make_demo_target", "main", "build (or reuse) the offline demo target"),
    "draft-calibration": ("draftsmith.scripts.draft_calibration", "main", "a head's draft confidence against its acceptance"),
    "cost": ("draftsmith.scripts.cost", "main", "what a training config costs per GPU before launch (memory, tokens, disk)"),
    "drift": ("draftsmith.scripts.drift", "cli", "the τ a head loses when its target changes, and whether to retrain it"),
    "speculation-plan": ("draftsmith.scripts.speculation_plan", "main",
                         "per batch size, the draft length that measures fastest (0 = off); the generator follows it"),
    "dump-features": ("draftsmith.scripts.dump_features", "main", "store the target's hidden states once; train with data.features"),
    "calibrate-layer-skip": ("draftsmith.scripts.calibrate_layer_skip", "main",
                             "the layer count k that drafts fastest by layer skip, measured on held-out prompts"),
    "rank-heads": ("draftsmith.scripts.rank_heads", "main", "trained heads ranked by real τ on held-out prompts, against their training metrics"),
    "plot-runs": ("draftsmith.scripts.plot_runs", "main", "held-out metrics of training runs, one plot"),
}

# old name -> the command that does it now
RENAMED = {"plan": "cost", "calibrate": "draft-calibration"}


def usage() -> str:
    """The command list printed by ``draftsmith --help``."""
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, _, what) in COMMANDS.items())
    return f"usage: draftsmith COMMAND [ARGS...]\n\ncommands:\n{rows}\n\n'draftsmith COMMAND --help' for a command's options."


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the command named by the first argument; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in RENAMED:
        print(f"error: 'draftsmith {name}' is now 'draftsmith {RENAMED[name]}'", file=sys.stderr)
        return 2
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[name]
    entry = getattr(importlib.import_module(module), function)
    from draftsmith.data.entry_point import run

    saved, sys.argv = sys.argv, [f"draftsmith {name}", *rest]  # argparse names the command in its usage lines
    try:
        return entry(rest) if function == "cli" else run(entry, rest)
    finally:
        sys.argv = saved  # a caller in this process (a test, a notebook) keeps its own


if __name__ == "__main__":
    sys.exit(main())
