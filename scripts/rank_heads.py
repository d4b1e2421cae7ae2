"""Real τ of trained heads beside their training-time metrics, and how well each metric ranks the heads.

    python scripts/rank_heads.py RUN_DIR [RUN_DIR ...] [--target demo:tiny] [--prompts 24]
        [--max-new-tokens 128] [--prompt-tokens 32] [--out results.json]

Each RUN_DIR is a training run's output_dir (the final head, its metrics.jsonl) or one of its checkpoints
(RUN/checkpoints/step-N: that step's head and evaluation). Real τ: every head decodes
the same held-out stdlib prompts (``data.corpus.continuation_prompts``, the benchmarks' prompts) greedily
with ``SpeculativeGenerator`` and its default draft shape (on CPU the adaptive chain), one prompt at a time;
τ = the verification steps' tokens over the steps, pooled over the prompts (``GenerationStats``). Every
decode is checked against the target's own greedy ``generate``. Beside it: the run's last evaluation's
simulated τ (``tau``) and decode τ (``decode_tau``), and the Spearman rank correlation of each with real τ.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftsmith.data.base.checks import cli_count
from draftsmith.data.base.paths import claim_report_file, json_with_keys
from draftsmith.data.entry_point import run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="training output_dirs (head + metrics.jsonl)")
    p.add_argument("--target", default="demo:tiny")
    p.add_argument("--prompts", type=cli_count(), default=24)
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompt-tokens", type=cli_count(), default=32)
    p.add_argument("--out", type=Path, default=None, help="write the rows and correlations as JSON here")
    args = p.parse_args(argv)
    for run in args.runs:
        if not (run_of(run)[0] / "metrics.jsonl").is_file():
            p.error(f"{run}: no metrics.jsonl (neither a training run's output_dir nor one of its checkpoints)")
    if args.out is not None:  # before any decoding: a user's file or a folder is refused (one line), never replaced
        claim_report_file(args.out, json_with_keys("rows", "spearman"), "head ranking")
    return args


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (nan when either side has no spread)."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def run_of(head_dir: Path) -> tuple[Path, int | None]:
    """(the run's output_dir, the checkpoint's step) of a run's output_dir (step None: its last evaluation) or
    of one of its checkpoints, ``RUN/checkpoints/step-NNNNNNN``."""
    if head_dir.parent.name == "checkpoints" and head_dir.name.startswith("step-"):
        return head_dir.parent.parent, int(head_dir.name.split("-")[1])
    return head_dir, None


def eval_record(head_dir: Path) -> dict:
    """The evaluation record (one with simulated ``tau``) of a run's final head or of a checkpoint's step."""
    run, step = run_of(head_dir)
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "tau" in r]
    evals = [r for r in evals if step is None or r["step"] == step]
    if not evals:
        raise SystemExit(f"{run}/metrics.jsonl holds no evaluation{'' if step is None else f' at step {step}'}")
    return evals[-1]


def load_head(head_dir: Path, scratch: Path):
    """A run's final head, or a checkpoint's (its head_config.json and weights, linked as a head folder)."""
    from draftsmith.heads import AutoHead
    from draftsmith.train.checkpoint import HEAD_CONFIG, MODEL_FILE

    if run_of(head_dir)[1] is not None:
        folder = scratch / f"{run_of(head_dir)[0].name}-{head_dir.name}"
        folder.mkdir()
        (folder / "config.json").symlink_to((head_dir / HEAD_CONFIG).resolve())
        (folder / MODEL_FILE).symlink_to((head_dir / MODEL_FILE).resolve())
        head_dir = folder
    return AutoHead.from_pretrained(str(head_dir)).eval()


def real_tau(target, head, prompts, references, max_new_tokens: int) -> tuple[float, bool]:
    """(pooled τ of greedy decodes of ``prompts``, whether every decode equals its reference)."""
    from draftsmith.infer.generator import SpeculativeGenerator

    gen = SpeculativeGenerator(target, head)
    steps = tokens = 0
    identical = True
    for prompt, reference in zip(prompts, references):
        out = gen.generate(prompt, max_new_tokens=max_new_tokens)
        identical &= bool(out.shape == reference.shape and (out == reference).all())
        steps, tokens = steps + gen.last_stats.steps, tokens + gen.last_stats.step_tokens
    return tokens / steps if steps else 0.0, identical


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from draftsmith.data.corpus import continuation_prompts
    from draftsmith.data.targets import load_target, load_target_tokenizer, resolve_target
    path = resolve_target(args.target)
    target = load_target(path, attn_implementation="sdpa").eval()
    tokenizer = load_target_tokenizer(path)
    prompts = [torch.tensor(p)[None] for p in
               continuation_prompts(tokenizer, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        references = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=args.max_new_tokens,
                                      do_sample=False, pad_token_id=pad) for p in prompts]
    rows = []
    scratch = Path(tempfile.mkdtemp())
    for run in args.runs:
        head = load_head(run, scratch)
        tau, identical = real_tau(target, head, prompts, references, args.max_new_tokens)
        record = eval_record(run)
        rows.append({"run": str(run), "step": record["step"], "real_tau": tau, "identical": identical,
                     "simulated_tau": record["tau"], "decode_tau": record.get("decode_tau")})
        print(f"{run}: real τ {tau:.3f} | decode τ {record.get('decode_tau', float('nan')):.3f} | simulated τ "
              f"{record['tau']:.3f} | step {record['step']} | identical {identical}", flush=True)
    real = [r["real_tau"] for r in rows]
    correlations = {key: spearman([r[key] for r in rows], real) for key in ("simulated_tau", "decode_tau")
                    if all(r[key] is not None for r in rows)}
    print("Spearman with real τ: " + ", ".join(f"{k} {v:.3f}" for k, v in correlations.items()))
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "spearman": correlations, "prompts": args.prompts,
                                        "max_new_tokens": args.max_new_tokens}, indent=1) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":  # a user's mistake (a missing target, a refused --out): one line, exit code 2
    sys.exit(run(main))
