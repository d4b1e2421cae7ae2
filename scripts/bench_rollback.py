"""What rolling back a hybrid target's recurrent states costs, per rollback (docs/hybrid.md).

    python scripts/bench_rollback.py --target demo:tiny-hybrid [--heads HEAD_DIR ...] [--rollback merged,replay]
        [--prompts 4] [--max-new-tokens 128] [--threads 1] [--out FILE.json]

Two measurements on one target, in one process:
1. plain decoding (the target's own greedy ``generate``, as ``scripts/benchmark.py``'s vanilla) and, for
   n-grams and each head in ``--heads``, ``SpeculativeGenerator`` with each ``--rollback`` (profiled), prompt
   by prompt, every method once per prompt in turn (interleaved: a load change on a shared machine hits them
   alike), after one warm-up run each; the prompts are ``scripts/benchmark.py``'s (held-out code, 128 tokens),
   EOS as the target's generation config says. Per method: τ, tokens/s, the speedup over plain decoding, whether
   every output equals plain decoding's, and per step: ms in the verify and in the rollback (restore, and
   the replay forwards of "replay" or of a "merged" step that falls back to one), tokens verified,
   replays, pending tokens re-verified;
2. the verify's cost t(N) for N = 1..16 (one forward over a chain of N after the first prompt): a merged
   step verifies its pending tokens and its draft in one t(p + N), a replayed one pays t(N) + t(p) (where
   per-position states would cost N · t(1): N one-token forwards, the only way through transformers'
   kernels to hold the state after every position);
3. with ``--paths``, t(P, D): one verify of P rows, each a chain of D after the same prompt (a tree's P
   root-to-leaf paths verified as rows sharing the prefix state, next to t(1, D) the chain): docs/hybrid.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from data.base.checks import cli_choices, cli_count, cli_counts

MODES = ("merged", "replay")
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo:tiny-hybrid", help="a hybrid target: HF id, directory or demo:<size>")
    p.add_argument("--heads", nargs="*", default=[], help="head directories, run after n-grams")
    p.add_argument("--rollback", type=cli_choices(MODES), default=",".join(MODES),
                   help="comma-separated rollbacks to compare: merged, replay")
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompts", type=cli_count(), default=4, help="stdlib prompts to decode")
    p.add_argument("--repeats", type=cli_count(), default=5, help="timed forwards per N")
    p.add_argument("--threads", type=cli_count(), help="CPU threads (default: measured, infer.threads)")
    p.add_argument("--paths", type=cli_counts(), help="comma-separated P: time a [P, D] verify (P rows of a chain of D)")
    p.add_argument("--depth", type=cli_count(), default=6, help="D for --paths: nodes per row, root included")
    p.add_argument("--out", help="write the results as JSON here too")
    return p.parse_args(argv)


def bench_prompts(tokenizer, count: int, max_new_tokens: int) -> list:
    """``count`` prompts (1, 128): the held-out code continuations ``scripts/benchmark.py`` runs by default."""
    import torch

    from data.corpus import continuation_prompts

    return [torch.tensor([ids]) for ids in continuation_prompts(tokenizer, count, 128, max_new_tokens)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(runs: list[dict], plain_s_per_token: float) -> dict:
    """One method's totals over its runs (each the stats of one ``generate``)."""
    total = {k: sum(r[k] for r in runs) for k in ("seconds", "tokens", "steps", "step_tokens", "verified",
                                                   "replays", "replayed", "pending", "verify_s", "rollback_s")}
    steps = max(total["steps"], 1)
    return {
        "tau": round(total["step_tokens"] / steps, 3),
        "tokens_per_s": round(total["tokens"] / total["seconds"], 2),
        "speedup": round(plain_s_per_token / (total["seconds"] / total["tokens"]), 3),
        "identical": all(r["identical"] for r in runs),
        "verify_ms_per_step": round(1000 * total["verify_s"] / steps, 3),
        "rollback_ms_per_step": round(1000 * total["rollback_s"] / steps, 3),
        "rollback_share_of_step_time": round(total["rollback_s"] / total["seconds"], 4),
        "verified_tokens_per_step": round(total["verified"] / steps, 2),
        "replays_per_step": round(total["replays"] / steps, 3),
        "replayed_tokens_per_step": round(total["replayed"] / steps, 2),
        "pending_tokens_per_step": round(total["pending"] / steps, 2),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # argument mistakes end here, before torch loads
    import torch

    from data.targets import load_target, load_target_tokenizer, resolve_target
    from heads import AutoHead
    from infer import SpeculativeGenerator
    from infer.drafters import chain_draft
    from infer.drafters.ngram import NgramDrafter
    from infer.recurrent import is_hybrid
    from infer.threads import choose_threads

    print(choose_threads(args.threads), file=sys.stderr, flush=True)
    path = resolve_target(args.target)
    target = load_target(path, dtype="auto", attn_implementation="sdpa").eval()
    if not is_hybrid(target):
        raise SystemExit(f"error: {args.target} keeps no recurrent state: nothing to roll back")
    tokenizer = load_target_tokenizer(path)
    drafters = {"ngram": NgramDrafter}  # a fresh drafter per generator: no state shared between methods
    drafters.update({h: (lambda h=h: AutoHead.from_pretrained(h).eval()) for h in args.heads})
    methods = {f"{name}:{mode}": SpeculativeGenerator(target, make(), rollback=mode, profile=True)
               for name, make in drafters.items() for mode in args.rollback}
    prompts = bench_prompts(tokenizer, args.prompts, args.max_new_tokens)

    def plain(ids):
        return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=args.max_new_tokens, pad_token_id=0)

    with torch.inference_mode():  # warm-up: first calls allocate caches and pick kernels
        plain(prompts[0])
        for gen in methods.values():
            gen.generate(prompts[0], max_new_tokens=args.max_new_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in methods}
    plain_s = plain_tokens = 0.0
    for ids in prompts:
        with torch.inference_mode():
            start = time.perf_counter()
            ref = plain(ids)
            plain_s += time.perf_counter() - start
        plain_tokens += ref.shape[1] - ids.shape[1]
        for name, gen in methods.items():
            out = gen.generate(ids, max_new_tokens=args.max_new_tokens)
            s = gen.last_stats
            runs[name].append({
                "seconds": s.wall_time, "tokens": s.new_tokens, "steps": s.steps, "step_tokens": s.step_tokens,
                "verified": s.verified_tokens, "replays": s.replays, "replayed": s.replayed_tokens,
                "pending": s.pending_tokens, "verify_s": s.phase_times.get("verify", 0.0),
                "rollback_s": s.phase_times.get("rollback", 0.0), "identical": torch.equal(out, ref)})
    results = {name: _summary(r, plain_s / plain_tokens) for name, r in runs.items()}
    # t(N): a verify of a chain of N after the first prompt's prefill (the same slots every time)
    gen = next(iter(methods.values()))
    ids = prompts[0]
    t = {}
    with torch.inference_mode():
        for n in SIZES:
            out = gen.prefill(ids, 64)
            before = out.past_key_values.states.checkpoint()
            draft = chain_draft([ids[0, -1]] * n, [])
            samples = []
            for _ in range(args.repeats):
                out.past_key_values.states.restore(before)
                samples.append(timed(lambda: gen.verify(out.past_key_values, draft)))
            t[n] = statistics.median(samples)
    t_paths = {}
    with torch.inference_mode():  # t(P, D): P rows after the same prompt, each verifying a chain of D
        for paths in sorted(set(args.paths) | {1}) if args.paths else []:
            out = gen.prefill(ids.expand(paths, -1), 64)
            before = out.past_key_values.states.checkpoint()
            drafts = [chain_draft([ids[0, -1]] * args.depth, [])] * paths
            samples = []
            for _ in range(args.repeats):
                out.past_key_values.states.restore(before)
                samples.append(timed(lambda: gen.verify(out.past_key_values, drafts)))
            t_paths[paths] = statistics.median(samples)
    result = {
        "target": args.target, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(), "command": " ".join(["python scripts/bench_rollback.py", *(sys.argv[1:] if argv is None else argv)]),
        "plain_tokens_per_s": round(plain_tokens / plain_s, 2), "methods": results,
        "t_verify_ms": {n: round(1000 * v, 3) for n, v in t.items()},
        "t_N_over_t_1": {n: round(v / t[1], 3) for n, v in t.items()},
    }
    if t_paths:
        result["t_paths_ms"] = {p: round(1000 * v, 3) for p, v in t_paths.items()}
        result["t_paths_over_t_1_path"] = {p: round(v / t_paths[1], 3) for p, v in t_paths.items()}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
