"""How much a head loses when its target changes (e.g. base -> a PEFT adapter on it, or Medusa-2's
merged target), and whether retraining it is worth it.

    draftsmith drift --head runs/demo-medusa --target ADAPTER_DIR [--old-target demo:tiny]

Both targets decode the same held-out prompts greedily with the head (``--old-target`` defaults to the
head's own target). Reported per target: τ (tokens per target forward) and the held-out loss of the
target itself on the demo corpus's held-out files; then how far the new target moved from the old
(greedy agreement: the share of each output identical to the old target's before they first differ)
and the τ the head lost. Refresh rule: retrain (warm-started, ``train.init_from=HEAD``) when the head
loses at least ``--threshold`` (default 5%) of its τ, since speed follows τ at a fixed verification
cost; below that a refresh buys less than run-to-run noise on our benchmarks.
"""
from __future__ import annotations

import argparse
import json
import sys

from typing import TYPE_CHECKING

from draftsmith.data.base.checks import cli_count, cli_real
from draftsmith.data.base.paths import claim_report_file, json_with_keys
from draftsmith.data.entry_point import prog, run
from draftsmith.infer.bench.prompts import load_prompts

if TYPE_CHECKING:
    from draftsmith.infer import SpeculativeGenerator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog("drift.py"), description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="trained head directory")
    p.add_argument("--target", required=True, help="the new target (directory, PEFT adapter, Hub id, demo:<size>)")
    p.add_argument("--old-target", help="the target the head was trained for (default: the head's own)")
    p.add_argument("--prompts", help="JSONL of {'prompt'} or {'messages'} rows (default: held-out demo code)")
    p.add_argument("--num-prompts", type=cli_count(), default=16)
    p.add_argument("--prompt-tokens", type=cli_count(), default=64)
    p.add_argument("--max-new-tokens", type=cli_count(), default=64)
    p.add_argument("--heldout-tokens", type=cli_count(), default=16384, help="held-out corpus tokens scored per target")
    p.add_argument("--threshold", type=cli_real(0, 1, above=True), default=0.05, help="relative τ loss from which a refresh is advised")
    p.add_argument("--threads", type=cli_count(), help="CPU threads (default: measured, as draftsmith generate)")
    p.add_argument("--out", help="also write the report as JSON here")
    args = p.parse_args(argv)
    return args


def heldout_loss(model, tokenizer, tokens: int) -> float:
    """Next-token loss in nats/token of ``model`` on the first ``tokens`` of the held-out corpus."""
    import torch

    from draftsmith.data.corpus import split_texts
    from draftsmith.data.demo_lm import pack

    length = min(512, getattr(model.config, "max_position_embeddings", None) or 512)
    blocks = pack(tokenizer, split_texts("heldout"), length)[: max(1, tokens // length)].to(model.device)
    total = 0.0
    with torch.no_grad():
        for batch in blocks.split(4):
            logits = model(input_ids=batch).logits[:, :-1].float()  # (B, T-1, V)
            total += torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="sum").item()
    return total / blocks[:, 1:].numel()


def decode(gen: SpeculativeGenerator, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """(τ over all prompts, greedy outputs)."""
    import torch

    new_tokens, forwards, outputs = 0, 0, []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=gen.target.device)
        out = gen.generate(ids, max_new_tokens=max_new_tokens)
        outputs.append(out[0, len(prompt):].tolist())
        new_tokens += gen.last_stats.new_tokens
        forwards += gen.last_stats.target_forwards
    return new_tokens / max(forwards, 1), outputs


def agreement(old: list[list[int]], new: list[list[int]]) -> float:
    """Mean share of each new output equal to the old one before their first difference."""
    shares = []
    for a, b in zip(old, new):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(a), 1))
    return sum(shares) / len(shares)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = claim_report_file(args.out, json_with_keys("targets", "tau_lost"), "drift report") if args.out else None
    from draftsmith.data.targets import check_head_source  # torch and transformers load only now: a mistake above is one line
    from draftsmith.heads import AutoHead
    from draftsmith.infer import SpeculativeGenerator

    check_head_source(args.head)
    head = AutoHead.from_pretrained(args.head)
    old_target = args.old_target or head.config.target_name_or_path
    if not old_target:
        raise ValueError(f"{args.head} records no target (target_name_or_path); pass --old-target")
    report: dict = {"head": args.head, "targets": {}}
    outputs = {}
    prompts = None
    for role, target in (("old", old_target), ("new", args.target)):
        gen = SpeculativeGenerator.from_pretrained(target, args.head, threads=args.threads)
        if gen.tokenizer is None:
            raise ValueError(f"{target} has no tokenizer; drift needs one for the prompts and the held-out text")
        prompts = prompts or load_prompts(args, gen.tokenizer)
        tau, outputs[role] = decode(gen, prompts, args.max_new_tokens)
        report["targets"][role] = {"target": str(target), "tau": round(tau, 3),
                                   "heldout_loss": round(heldout_loss(gen.target, gen.tokenizer, args.heldout_tokens), 4)}
        print(f"{role} target {target}: τ {tau:.3f}, held-out loss {report['targets'][role]['heldout_loss']:.4f} "
              "nats/token", file=sys.stderr)
    old, new = report["targets"]["old"], report["targets"]["new"]
    lost = 1 - new["tau"] / old["tau"]
    report.update({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                   "greedy_agreement": round(agreement(outputs["old"], outputs["new"]), 3),
                   "tau_lost": round(lost, 4), "refresh": lost >= args.threshold, "threshold": args.threshold})
    advice = (f"refresh: retrain warm-started, target={args.target} train.init_from={args.head}"
              if report["refresh"] else "no refresh needed")
    change = f"loses {100 * lost:.1f}% of its τ" if lost >= 0 else f"gains {-100 * lost:.1f}% τ"
    print(f"greedy agreement {report['greedy_agreement']:.3f}; the head {change} on the new target "
          f"(refresh from a {100 * args.threshold:.0f}% loss): {advice}")
    if args.out:
        out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
