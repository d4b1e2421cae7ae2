"""How confident a head's drafts are against how often greedy verification accepts them.

    draftsmith draft-calibration --target DIR --heads HEAD_DIR [HEAD_DIR ...]
        [--num-prompts 8] [--prompt-tokens 128] [--max-new-tokens 96]

Decodes held-out demo-corpus prompts greedily with one draft per step (``Chain(1)``) and reports,
per head: the mean probability the head gives its own top-1 draft, the share of those drafts the
target accepts, and the mean probability the target gives its own greedy token. EAGLE-2's dynamic
tree keeps the nodes with the highest joint draft probability, which estimates acceptance when
drafts are calibrated; under greedy verification a draft is accepted whenever the argmaxes agree, so
a head with low top-1 probabilities but high agreement gets shallow trees (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from draftsmith.data.base.checks import cli_count
from draftsmith.data.entry_point import prog


def calibration(target, head, prompts: list[list[int]], max_new_tokens: int) -> dict[str, float]:
    """Mean draft top-1 probability against greedy acceptance for one EAGLE head, over ``prompts``."""
    import torch

    from draftsmith.infer import Chain, SpeculativeGenerator
    from draftsmith.infer.drafters.eagle import EagleDrafter

    gen = SpeculativeGenerator(target, head, tree=Chain(1))
    drafter = gen.drafter
    if not isinstance(drafter, EagleDrafter):
        raise ValueError(f"draft calibration reads an EAGLE head's draft logits; a {head.head_kind} head has none")
    draft_probs: list[float] = []
    compute = drafter._logits

    def recording(hidden):
        """The head's draft logits, recording their top-1 probability."""
        logits = compute(hidden)
        draft_probs.append(float(logits.softmax(-1).max()))  # sync: one float per draft
        return logits

    drafter._logits = recording  # the instance attribute shadows the method for this generator only
    accepted, steps, target_probs = 0, 0, []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        out = gen.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[])
        stats = gen.last_stats
        accepted += stats.step_tokens - stats.steps  # each step emits its accepted draft (0 or 1) + a bonus
        steps += stats.steps
        with torch.inference_mode():
            logits = target(out).logits[0, ids.shape[1] - 1: -1].float()
        target_probs.append(float(logits.softmax(-1).max(-1).values.mean()))
    return {"draft_top1_prob": statistics.fmean(draft_probs), "accepted": accepted / max(1, steps),
            "target_top1_prob": statistics.fmean(target_probs), "drafts": len(draft_probs), "steps": steps}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Calibrate every head in ``--heads`` on the same prompts; prints and returns the numbers."""
    p = argparse.ArgumentParser(prog=prog("draft_calibration.py"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--heads", nargs="+", required=True)
    p.add_argument("--num-prompts", type=cli_count(), default=8)
    p.add_argument("--prompt-tokens", type=cli_count(), default=128)
    p.add_argument("--max-new-tokens", type=cli_count(), default=96)
    args = p.parse_args(argv)  # before torch loads: a mistake is one line in a second
    from draftsmith.data.targets import load_target, load_target_tokenizer, resolve_target  # demo:<size>, adapters
    from draftsmith.heads import AutoHead

    target_path = resolve_target(args.target)
    target = load_target(target_path, attn_implementation="sdpa").eval()
    tokenizer = load_target_tokenizer(target_path)
    from draftsmith.data.corpus import continuation_prompts

    prompts = continuation_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.max_new_tokens)
    results = {}
    print("| head | draft top-1 probability | drafts accepted | target top-1 probability |\n|---|---:|---:|---:|")
    for head_dir in args.heads:
        r = calibration(target, AutoHead.from_pretrained(head_dir).eval(), prompts, args.max_new_tokens)
        results[head_dir] = r
        print(f"| {head_dir} | {r['draft_top1_prob']:.3f} | {r['accepted']:.3f} | {r['target_top1_prob']:.3f} |")
    return results


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
