"""What rolling back a hybrid target's recurrent states costs (docs/hybrid.md).

    python scripts/bench_rollback.py --target demo:tiny-hybrid [--drafter ngram] [--max-new-tokens 128]

Two measurements on one target, interleaved:
1. ``SpeculativeGenerator`` with ``profile=True`` on a few stdlib prompts: the share of a step spent in
   the rollback (checkpoint restore + replay of the accepted tokens), replays per step and tokens
   replayed per replay, next to τ;
2. the verify's cost t(N) for N = 1..8 (one forward over a chain of N after a 48-token prompt), from
   which docs/hybrid.md compares the two ways to roll back per step: replay (what draftsmith does: t(N),
   then t(a) when only a < N are accepted) and per-position states (N one-token forwards, the only way
   through transformers' kernels to hold the state after every position: N · t(1)).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from data.base.checks import cli_count


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo:tiny-hybrid", help="a hybrid target: HF id, directory or demo:<size>")
    p.add_argument("--head", help="a head directory (default: n-gram drafts)")
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompts", type=cli_count(), default=4, help="stdlib prompts to decode")
    p.add_argument("--repeats", type=cli_count(), default=5, help="timed forwards per N")
    p.add_argument("--threads", type=cli_count(), help="CPU threads (default: measured, infer.threads)")
    p.add_argument("--out", help="write the results as JSON here too")
    return p.parse_args(argv)


def stdlib_prompts(tokenizer, count: int, length: int = 48) -> list:
    """``count`` prompts (1, length) of stdlib source, tokenized."""
    import inspect
    import json as json_module
    import textwrap

    import torch

    texts = [inspect.getsource(m) for m in (textwrap, json_module.decoder, argparse)]
    return [torch.tensor([tokenizer(t)["input_ids"][:length]]) for t in texts * count][:count]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # argument mistakes end here, before torch loads
    import torch

    from data.targets import resolve_target
    from infer import SpeculativeGenerator
    from infer.drafters import chain_draft
    from infer.drafters.ngram import NgramDrafter
    from infer.recurrent import is_hybrid

    head = args.head
    gen = SpeculativeGenerator.from_pretrained(resolve_target(args.target), head or (lambda t: NgramDrafter()),
                                               threads=args.threads, profile=True)
    if not is_hybrid(gen.target):
        raise SystemExit(f"error: {args.target} keeps no recurrent state: nothing to roll back")
    phases: dict[str, float] = {}
    steps = replays = replayed = tokens = 0
    for ids in stdlib_prompts(gen.tokenizer, args.prompts):
        gen.generate(ids, max_new_tokens=args.max_new_tokens)
        s = gen.last_stats
        for k, v in s.phase_times.items():
            phases[k] = phases.get(k, 0.0) + v
        steps, replays, replayed, tokens = steps + s.steps, replays + s.replays, replayed + s.replayed_tokens, \
            tokens + s.step_tokens
    step_time = sum(v for k, v in phases.items() if k != "prefill")
    # t(N): a verify of a chain of N after the first prompt's prefill (the same slots every time)
    ids = stdlib_prompts(gen.tokenizer, 1)[0]
    t = {}
    with torch.inference_mode():
        for n in range(1, 9):
            out = gen.prefill(ids, 64)
            before = out.past_key_values.states.checkpoint()
            draft = chain_draft([ids[0, -1]] + [ids[0, -1]] * (n - 1), [])
            runs = []
            for _ in range(args.repeats):
                out.past_key_values.states.restore(before)
                runs.append(timed(lambda: gen.verify(out.past_key_values, draft)))
            t[n] = statistics.median(runs)
    tau = tokens / steps if steps else 0.0
    result = {
        "target": args.target, "drafter": head or "ngram", "steps": steps, "tau": round(tau, 3),
        "rollback_share_of_step_time": round(phases.get("rollback", 0.0) / step_time, 4) if step_time else 0.0,
        "replays_per_step": round(replays / steps, 3) if steps else 0.0,
        "tokens_per_replay": round(replayed / replays, 2) if replays else 0.0,
        "phase_seconds": {k: round(v, 4) for k, v in phases.items()},
        "t_verify_ms": {n: round(1000 * v, 3) for n, v in t.items()},
        "t_N_over_t_1": {n: round(v / t[1], 3) for n, v in t.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
