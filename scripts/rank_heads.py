"""Real τ of trained heads beside their training-time metrics, and how well each metric ranks the heads.

    draftsmith rank-heads RUN_DIR [RUN_DIR ...] [--target demo:tiny] [--prompts 24] [--max-new-tokens 128]
        [--prompt-tokens 32] [--temperatures 0,0.7,1] [--top-p 1] [--top-k 0] [--out results.json]

Each RUN_DIR is a training run's output_dir (the final head, its metrics.jsonl) or one of its checkpoints
(RUN/checkpoints/step-N: that step's head and evaluation). Real τ: at each of ``--temperatures`` every head decodes
the same held-out stdlib prompts (``data.corpus.continuation_prompts``, the benchmarks' prompts) with
``SpeculativeGenerator`` and its default draft shape (on CPU the adaptive chain), one prompt at a time, each under
its own seed (``infer.seeded_decode``: training's decode τ draws alike); τ = the verification steps' tokens over
the steps, pooled over the prompts, with its 95% interval over them, tokens/s, and vLLM's acceptance names
(``mean_acceptance_length``, ``num_accepted_tokens_per_pos``, the acceptance histogram: counts summed over the
prompts first). Every greedy decode is checked against the target's own ``generate``. Beside it: the run's last
evaluation's simulated τ (``tau``) and decode τ at each temperature it measured (``decode_tau``,
``decode_tau_t<T>``), and the Spearman rank correlation of each with real τ at its temperature (simulated τ: at
the first of ``--temperatures``).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_real, cli_temperatures
from draftsmith.data.base.paths import claim_report_file, json_with_keys
from draftsmith.data.entry_point import run
from draftsmith.train.ranking import correlations, ranks, real_taus, spearman  # noqa: F401  (re-exported)
from draftsmith.train.settings import decode_tau_key


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="training output_dirs (head + metrics.jsonl)")
    p.add_argument("--target", default="demo:tiny")
    p.add_argument("--prompts", type=cli_count(), default=24)
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompt-tokens", type=cli_count(), default=32)
    p.add_argument("--temperatures", type=cli_temperatures, default=[0.0, 0.7, 1.0],
                   help="comma-separated sampling temperatures to decode at (0 = greedy)")
    p.add_argument("--top-p", type=cli_real(0, 1, above=True), default=1.0, help="top-p at T > 0 (1 = off)")
    p.add_argument("--top-k", type=cli_count(0), default=0, help="top-k at T > 0 (0 = off)")
    p.add_argument("--out", type=Path, default=None, help="write the rows and correlations as JSON here")
    args = p.parse_args(argv)
    for run in args.runs:
        if not (run_of(run)[0] / "metrics.jsonl").is_file():
            p.error(f"{run}: no metrics.jsonl (neither a training run's output_dir nor one of its checkpoints)")
    if args.out is not None:  # before any decoding: a user's file or a folder is refused (one line), never replaced
        claim_report_file(args.out, json_with_keys("rows", "spearman"), "head ranking")
    return args


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
        record = eval_record(run)
        measured = real_taus(target, load_head(run, scratch), prompts, references, args)
        decoded = {k: v for k, v in record.items() if k.startswith("decode_tau")}
        rows.append({"run": str(run), "step": record["step"], **measured, "simulated_tau": record["tau"],
                     "decode_tau": record.get("decode_tau"), **decoded})
        for t in args.temperatures:
            real, dec = decode_tau_key(t, "real_tau"), decode_tau_key(t)
            print(f"{run} T={t:g}: real τ {measured[real]:.3f} | decode τ {record.get(dec, float('nan')):.3f} | "
                  f"mean_acceptance_length {measured[decode_tau_key(t, 'mean_acceptance_length')]:.3f} | "
                  f"{measured[decode_tau_key(t, 'tokens_per_s')]:.1f} tokens/s | simulated τ {record['tau']:.3f} | "
                  f"step {record['step']} | identical {measured['identical']}", flush=True)
    found = correlations(rows, args.temperatures)
    print("Spearman with real τ: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()))
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "spearman": found, "prompts": args.prompts,
                                        "max_new_tokens": args.max_new_tokens, "temperatures": args.temperatures,
                                        "top_p": args.top_p, "top_k": args.top_k}, indent=1) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":  # a user's mistake (a missing target, a refused --out): one line, exit code 2
    sys.exit(run(main))
