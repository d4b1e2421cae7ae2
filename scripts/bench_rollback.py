"""What rolling back a hybrid target's recurrent states costs, per rollback (docs/hybrid.md).

    python scripts/bench_rollback.py --target demo:tiny-hybrid [--heads HEAD_DIR ...] [--rollback merged,replay]
        [--prompts 4] [--max-new-tokens 128] [--threads 1] [--rules per-token,chunked]
        [--reference-target demo:tiny [--reference-heads HEAD_DIR ...]] [--out FILE.json]

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
   with ``--rules per-token,chunked`` every method and every t(N) runs twice, interleaved: with the generator's
   routing of short verifies to the per-token Gated DeltaNet rule (infer.delta_rule, "per-token", what the
   generator does) and without it (every multi-token forward on the chunked rule, "chunked": the routing
   off); with ``--reference-target`` (an attention target, e.g. demo:tiny), plain decoding, n-grams and each
   ``--reference-heads`` head on it too (each with the generator's defaults), prompt by prompt in turn with
   the hybrid's methods, and its t(N) beside the hybrid's (the same prompt ids: both demo targets share a
   tokenizer): the speedups of both targets under the same load;
3. with ``--paths``, t(P, D): one verify of P rows, each a chain of D after the same prompt (a tree's P
   root-to-leaf paths verified as rows sharing the prefix state, next to t(1, D) the chain): docs/hybrid.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from draftsmith.data.base.checks import cli_choices, cli_count, cli_counts

MODES = ("merged", "replay")
RULES = ("per-token", "chunked")  # short verifies on the per-token Gated DeltaNet rule (the generator's), or not
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
    p.add_argument("--rules", type=cli_choices(RULES), default="per-token",
                   help="comma-separated: per-token (the generator's routing of short verifies, infer.delta_rule), "
                        "chunked (the routing off)")
    p.add_argument("--reference-target", help="an attention target decoded (n-grams and --reference-heads) and timed "
                                               "(t(N)) beside the hybrid, in turn")
    p.add_argument("--reference-heads", nargs="*", default=[], help="head directories for --reference-target")
    p.add_argument("--paths", type=cli_counts(), help="comma-separated P: time a [P, D] verify (P rows of a chain of D)")
    p.add_argument("--depth", type=cli_count(), default=6, help="D for --paths: nodes per row, root included")
    p.add_argument("--out", help="write the results as JSON here too")
    args = p.parse_args(argv)
    if args.reference_heads and not args.reference_target:
        p.error("--reference-heads needs --reference-target")
    return args


def bench_prompts(tokenizer, count: int, max_new_tokens: int) -> list:
    """``count`` prompts (1, 128): the held-out code continuations ``scripts/benchmark.py`` runs by default."""
    import torch

    from draftsmith.data.corpus import continuation_prompts

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

    from draftsmith.data.targets import load_target, load_target_tokenizer, resolve_target
    from draftsmith.heads import AutoHead
    from draftsmith.infer import SpeculativeGenerator
    from draftsmith.infer.drafters import chain_draft
    from draftsmith.infer.drafters.ngram import NgramDrafter
    from draftsmith.infer.recurrent import is_hybrid
    from draftsmith.infer.threads import choose_threads

    print(choose_threads(args.threads), file=sys.stderr, flush=True)
    path = resolve_target(args.target)
    target = load_target(path, dtype="auto", attn_implementation="sdpa").eval()
    if not is_hybrid(target):
        raise SystemExit(f"error: {args.target} keeps no recurrent state: nothing to roll back")
    tokenizer = load_target_tokenizer(path)
    drafters = {"ngram": NgramDrafter}  # a fresh drafter per generator: no state shared between methods
    drafters.update({h: (lambda h=h: AutoHead.from_pretrained(h).eval()) for h in args.heads})
    def generator(model, drafter, rule: str, **options):
        gen = SpeculativeGenerator(model, drafter, **options)
        if rule == "chunked":
            gen.per_token_modules = ()  # the routing off: every multi-token forward runs the chunked rule
        return gen

    methods = {f"{name}:{mode}" + (f":{rule}" if len(args.rules) > 1 else ""):
               generator(target, make(), rule, rollback=mode, profile=True)
               for name, make in drafters.items() for mode in args.rollback for rule in args.rules}
    prompts = bench_prompts(tokenizer, args.prompts, args.max_new_tokens)

    groups = {"target": (target, methods)}
    if args.reference_target:  # an attention target decoded beside the hybrid, prompt by prompt in turn
        reference = load_target(resolve_target(args.reference_target), dtype="auto", attn_implementation="sdpa").eval()
        made = {"ngram": NgramDrafter, **{h: (lambda h=h: AutoHead.from_pretrained(h).eval()) for h in args.reference_heads}}
        groups["reference"] = (reference, {name: SpeculativeGenerator(reference, make(), profile=True)
                                           for name, make in made.items()})

    def plain(model, ids):
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=args.max_new_tokens, pad_token_id=0)

    with torch.inference_mode():  # warm-up: first calls allocate caches and pick kernels
        for model, gens in groups.values():
            plain(model, prompts[0])
            for gen in gens.values():
                gen.generate(prompts[0], max_new_tokens=args.max_new_tokens)
    runs: dict[str, dict[str, list[dict]]] = {g: {name: [] for name in gens} for g, (_, gens) in groups.items()}
    plain_s, plain_tokens = dict.fromkeys(groups, 0.0), dict.fromkeys(groups, 0)
    for ids in prompts:
        for g, (model, gens) in groups.items():
            with torch.inference_mode():
                start = time.perf_counter()
                ref = plain(model, ids)
                plain_s[g] += time.perf_counter() - start
            plain_tokens[g] += ref.shape[1] - ids.shape[1]
            for name, gen in gens.items():
                out = gen.generate(ids, max_new_tokens=args.max_new_tokens)
                s = gen.last_stats
                runs[g][name].append({
                    "seconds": s.wall_time, "tokens": s.new_tokens, "steps": s.steps, "step_tokens": s.step_tokens,
                    "verified": s.verified_tokens, "replays": s.replays, "replayed": s.replayed_tokens,
                    "pending": s.pending_tokens, "verify_s": s.phase_times.get("verify", 0.0),
                    "rollback_s": s.phase_times.get("rollback", 0.0), "identical": torch.equal(out, ref)})
    results = {g: {name: _summary(r, plain_s[g] / plain_tokens[g]) for name, r in runs[g].items()} for g in groups}
    # t(N): a verify of a chain of N after the first prompt's prefill (the same slots every time), each rule's
    # generator (and the reference target's) in turn for every N and repeat
    timers = {rule: generator(target, NgramDrafter(), rule) for rule in args.rules}
    if args.reference_target:
        timers[args.reference_target] = SpeculativeGenerator(reference, NgramDrafter())
    ids = prompts[0]
    samples = {(who, n): [] for who in timers for n in SIZES}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for n in SIZES:
                for who, gen in timers.items():
                    out = gen.prefill(ids, 64)
                    states = getattr(out.past_key_values, "states", None)
                    before = states.checkpoint() if states is not None else None
                    draft = chain_draft([ids[0, -1]] * n, [])
                    for _ in range(2):  # the first forward after a prefill warms its shapes up
                        if before is not None:
                            states.restore(before)
                        took = timed(lambda: gen.verify(out.past_key_values, draft))
                    samples[(who, n)].append(took)
    t_by = {who: {n: statistics.median(samples[(who, n)]) for n in SIZES} for who in timers}
    t = t_by[args.rules[0]]
    gen = next(iter(methods.values()))
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
        "plain_tokens_per_s": round(plain_tokens["target"] / plain_s["target"], 2), "methods": results["target"],
        "t_verify_ms": {n: round(1000 * v, 3) for n, v in t.items()},
        "t_N_over_t_1": {n: round(v / t[1], 3) for n, v in t.items()},
    }
    if args.reference_target:
        result["reference"] = {"target": args.reference_target, "methods": results["reference"],
                               "plain_tokens_per_s": round(plain_tokens["reference"] / plain_s["reference"], 2)}
    if len(t_by) > 1:
        result["t_verify_ms_by"] = {who: {n: round(1000 * v, 3) for n, v in tw.items()} for who, tw in t_by.items()}
        result["t_N_over_t_1_by"] = {who: {n: round(v / tw[1], 3) for n, v in tw.items()} for who, tw in t_by.items()}
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
