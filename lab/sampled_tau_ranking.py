"""Does decode τ at T > 0, as training computes it, rank heads as their real τ at that T does? (issue 57)

    python lab/sampled_tau_ranking.py HEAD [HEAD ...] [--temperature 1] [--prompts 24] [--max-new-tokens 128]
        [--prompt-tokens 32] [--eval-rows N] [--real-from FILE.json] [--out FILE.json]

Each HEAD is a training run's output_dir or one of its checkpoints (RUN/checkpoints/step-N), as ``draftsmith
rank-heads`` reads them; every head must come from runs of one target and held-out set. Training's decode τ at T:
the first run's config (its config.yaml) with ``train.eval_temperature=[T]``, its held-out rows and decode set
made by training's own functions (``train.evaluation.decode_set_for``: the first ``train.eval_decode_rows``
held-out prompts, ``--eval-rows`` to change it, × ``train.eval_decode_tokens``), each head decoded by
``train.evaluation.decode_at``: the number a run with ``train.eval_temperature=[T]`` logs for that head. Real τ at
T: ``draftsmith rank-heads``' (``--prompts`` held-out stdlib prompts × ``--max-new-tokens``, the generator, each
prompt under its own seed). Prints one row per head and Spearman's rank correlation of the two over the heads;
``--out`` keeps them as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_real


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("heads", nargs="+", type=Path, help="training output_dirs or their checkpoints")
    p.add_argument("--temperature", type=cli_real(0, above=True), default=1.0)
    p.add_argument("--prompts", type=cli_count(), default=24)
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompt-tokens", type=cli_count(), default=32)
    p.add_argument("--eval-rows", type=cli_count(), default=None,
                   help="train.eval_decode_rows for training's decode τ (default: the run's)")
    p.add_argument("--real-from", type=Path, default=None,
                   help="take each head's real τ from this earlier --out (same heads, prompts and T) instead of decoding")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def training_decode_set(head_dir: Path, temperature: float, eval_rows: int | None, head):
    """(accelerator, cfg, target, tokenizer, decode set) as the run of ``head_dir`` makes them at its first evaluation."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from draftsmith.data.targets import resolve_target
    from draftsmith.scripts.rank_heads import run_of
    from draftsmith.train.config import load_config
    from draftsmith.train.evaluation import decode_set_for
    from draftsmith.train.examples import data_sources, load_examples
    from draftsmith.train.run import load_frozen_target

    run = run_of(head_dir)[0]
    overrides = [f"train.eval_temperature=[{temperature}]", "train.best_by=auto", f"output_dir={run}"]
    cfg = load_config(run / "config.yaml", overrides + ([f"train.eval_decode_rows={eval_rows}"] if eval_rows else []))
    accelerator = Accelerator(cpu=True)
    tokenizer, target, identity = load_frozen_target(cfg, resolve_target(cfg.target), accelerator.device)
    _, eval_source = data_sources(cfg, target, tokenizer, progress=False)
    eval_set, _ = load_examples(eval_source, tokenizer, cfg, identity["vocab_size"], "data.eval")
    eval_set = eval_set.select(range(min(cfg.data.eval_rows, len(eval_set))))
    decode_set = decode_set_for(accelerator, head, target, DataLoader(eval_set), cfg)
    return accelerator, cfg, target, tokenizer, decode_set


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from draftsmith.data.corpus import continuation_prompts
    from draftsmith.scripts.rank_heads import eval_record, load_head
    from draftsmith.train.evaluation import decode_at
    from draftsmith.train.ranking import real_taus, spearman
    from draftsmith.train.settings import decode_tau_key

    scratch = Path(tempfile.mkdtemp())
    heads = [load_head(h, scratch) for h in args.heads]
    accelerator, cfg, target, tokenizer, decode_set = training_decode_set(args.heads[0], args.temperature,
                                                                          args.eval_rows, heads[0])
    prompts = [torch.tensor(p)[None] for p in
               continuation_prompts(tokenizer, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    real_args = argparse.Namespace(temperatures=[args.temperature], max_new_tokens=args.max_new_tokens, top_p=1.0,
                                   top_k=0)
    key, real_key = decode_tau_key(args.temperature), decode_tau_key(args.temperature, "real_tau")
    rows, known = [], {}
    if args.real_from is not None:  # real τ measured before on the same prompts: its rows' real_tau* and acceptance
        for old in json.loads(args.real_from.read_text())["rows"]:
            known[old["head"]] = {k: v for k, v in old.items() if k.startswith(("real_tau", "tokens_per_s",
                                                                                 "mean_acceptance_length", "acceptance"))}
    for head_dir, head in zip(args.heads, heads):
        decoded = decode_at(accelerator, head, target, decode_set, args.temperature)
        real = known.get(str(head_dir)) or real_taus(target, head, prompts, [], real_args)
        record = eval_record(head_dir)  # the set is training's: greedy decode τ on it is the run's logged one
        greedy = decode_at(accelerator, head, target, decode_set, 0.0)["decode_tau"] if args.eval_rows is None else None
        row = {"head": str(head_dir), "step": record["step"], **decoded, "greedy_decode_tau": greedy,
               "logged": {k: v for k, v in record.items() if k.startswith("decode_tau")},
               **{k: v for k, v in real.items() if k != "identical"}}
        if greedy is not None and "decode_tau" in record and abs(greedy - record["decode_tau"]) > 1e-9:
            raise ValueError(f"{head_dir}: decode τ on this set is {greedy}, the run logged {record['decode_tau']}: "
                             "not the run's decode set")
        rows.append(row)
        print(f"{head_dir}: decode τ T={args.temperature:g} {row[key]:.3f} [{row[key + '_low']:.3f}, "
              f"{row[key + '_high']:.3f}] | real τ {row[real_key]:.3f} [{row[real_key + '_low']:.3f}, "
              f"{row[real_key + '_high']:.3f}] | {row[decode_tau_key(args.temperature, 'decode_seconds')]:.1f} s",
              flush=True)
    rho = spearman([r[key] for r in rows], [r[real_key] for r in rows])
    print(f"Spearman of training's decode τ with real τ at T={args.temperature:g} over {len(rows)} heads: {rho:.3f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "spearman": rho, "temperature": args.temperature,
                                        "eval_decode_rows": cfg.train.eval_decode_rows,
                                        "eval_decode_tokens": cfg.train.eval_decode_tokens, "prompts": args.prompts,
                                        "max_new_tokens": args.max_new_tokens}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
