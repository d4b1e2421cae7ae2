"""What rolling back a hybrid target's recurrent states costs, per rollback (docs/hybrid.md).

    python lab/bench_rollback.py --target demo:tiny-hybrid [--heads HEAD_DIR ...] [--rollback recorded,merged,replay]
        [--prompts 4] [--max-new-tokens 128] [--threads 1] [--rules per-token,chunked]
        [--reference-target demo:tiny [--reference-heads HEAD_DIR ...]] [--out FILE.json]
    python lab/bench_rollback.py --oracle 4/1,4/3,8/3,8/6 --target random:gated-deltanet,random:mamba2 \
        --reference-target random:attention --threads 1 [--out FILE.json]

Two measurements on one target, in one process:
1. plain decoding (the target's own greedy ``generate``, as ``scripts/benchmark.py``'s vanilla) and, for
   n-grams and each head in ``--heads``, ``SpeculativeGenerator`` with each ``--rollback`` (profiled), prompt
   by prompt, every method once per prompt in turn (interleaved: a load change on a shared machine hits them
   alike), after one warm-up run each; the prompts are ``scripts/benchmark.py``'s (held-out code, 128 tokens),
   EOS as the target's generation config says. Per method: τ, tokens/s, the speedup over plain decoding, whether
   every output equals plain decoding's, and per step: ms in the verify and in the rollback (restore, and
   the replay forwards of "replay" or of a "merged" step that falls back to one), tokens verified,
   replays, pending tokens re-verified;
2. the verify's cost t(N) for N = 1..16 (one forward over a chain of N after the first prompt): a recorded
   step pays t(N) and keeps the accepted position's states, a merged one verifies its pending tokens and its
   draft in one t(p + N), a replayed one pays t(N) + t(p);
   with ``--rules per-token,chunked`` every method and every t(N) runs twice, interleaved: with the generator's
   routing of short verifies to the per-token Gated DeltaNet rule (target.delta_rule, "per-token", what the
   generator does) and without it (the Gated DeltaNet layers' multi-token forwards on the chunked rule,
   "chunked"; what exactness needs stays routed: Mamba mixers per token, Mamba-2 scans without the dt clamp); with ``--reference-target`` (an attention target, e.g. demo:tiny), plain decoding, n-grams and each
   ``--reference-heads`` head on it too (each with the generator's defaults), prompt by prompt in turn with
   the hybrid's methods, and its t(N) beside the hybrid's (the same prompt ids: both demo targets share a
   tokenizer): the speedups of both targets under the same load;
3. with ``--paths``, t(P, D): one verify of P rows, each a chain of D after the same prompt (a tree's P
   root-to-leaf paths verified as rows sharing the prefix state, next to t(1, D) the chain): docs/hybrid.md.
4. with ``--oracle D/A,...``, speed at equal τ: every target in ``--target`` (comma-separated hybrids) and the
   ``--reference-target`` (an attention target) decode the same prompts with a drafter right for the first A
   of D drafted tokens at every step (``infer.bench.oracle``: τ = A + 1, a partial accept, so a rollback,
   every step), each beside its own plain decoding, prompt by prompt in turn. Per (D, A): each target's
   speedup over its plain decoding, the hybrid's over the reference's (the goal: >= 0.85), the rollback's
   share of the step, and each phase's time per step over the target's t(1) (plain decoding's time per
   token): where a hybrid's step costs more than the reference's. ``random:attention``,
   ``random:gated-deltanet``, ``random:mamba2`` and ``random:short-conv`` are randomly initialised models of
   demo:tiny's size (Llama; the Qwen3.5 hybrid of demo:tiny-hybrid; a Bamba hybrid with Mamba-2 and an LFM2 with
   short convs where the Qwen3.5 one has Gated DeltaNet), on random prompts. The hybrids run the generator's default rollback, or the one
   ``--rollback`` names alone.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

from draftsmith.data.base.checks import cli_choices, cli_count, cli_counts
from draftsmith.data.base.paths import claim_report_file, json_with_keys
from draftsmith.data.entry_point import run

MODES = ("recorded", "merged", "replay")
RULES = ("per-token", "chunked")  # short verifies on the per-token Gated DeltaNet rule (the generator's), or not
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
ORACLE_POINTS = "4/1,4/3,8/3,8/6"
# Randomly initialised targets of demo:tiny's size (data.demo_lm's "tiny" and "tiny-hybrid" settings)
_DEMO = dict(vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=3,
             num_key_value_heads=1, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)
RANDOM_TARGETS = {
    "random:attention": ("llama", {}),
    "random:gated-deltanet": ("qwen3_5_text", dict(
        head_dim=64, layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4)),
    "random:mamba2": ("bamba", dict(attn_layer_indices=[3, 7], mamba_n_heads=12, mamba_d_head=32, mamba_d_state=32,
                                    mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2)),  # 12 x 32 = 2 x 192
    "random:short-conv": ("lfm2", dict(layer_types=["conv", "conv", "conv", "full_attention"] * 2, conv_L_cache=3,
                                       block_auto_adjust_ff_dim=False)),  # LFM2: short conv, attention in 3 and 7
}
REPORT_KEYS = ("target", "command")  # what every report this script writes holds (--out may replace only those)


def cli_oracle_points(text: str) -> list[tuple[int, int]]:
    """``D/A,...``: D drafted tokens of which the first A are right (1 <= A < D)."""
    points = []
    for item in text.split(","):
        depth, _, right = item.partition("/")
        if not (depth.strip().isdigit() and right.strip().isdigit() and 1 <= int(right) < int(depth)):
            raise argparse.ArgumentTypeError(f"D/A pairs with 1 <= A < D expected, got {item!r}")
        points.append((int(depth), int(right)))
    return points


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="demo:tiny-hybrid", help="a hybrid target: HF id, directory, demo:<size> or "
                                                                 "(with --oracle) random:<kind>; --oracle: comma-separated")
    p.add_argument("--heads", nargs="*", default=[], help="head directories, run after n-grams")
    p.add_argument("--rollback", type=cli_choices(MODES), default=",".join(MODES),
                   help="comma-separated rollbacks to compare: merged, replay")
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompts", type=cli_count(), default=4, help="stdlib prompts to decode")
    p.add_argument("--repeats", type=cli_count(), default=5, help="timed forwards per N")
    p.add_argument("--threads", type=cli_count(), help="CPU threads (default: measured, target.threads)")
    p.add_argument("--rules", type=cli_choices(RULES), default="per-token",
                   help="comma-separated: per-token (the generator's routing of short verifies, target.delta_rule), "
                        "chunked (the Gated DeltaNet rule off; exactness routing stays)")
    p.add_argument("--reference-target", help="an attention target decoded (n-grams and --reference-heads) and timed "
                                               "(t(N)) beside the hybrid, in turn")
    p.add_argument("--reference-heads", nargs="*", default=[], help="head directories for --reference-target")
    p.add_argument("--paths", type=cli_counts(), help="comma-separated P: time a [P, D] verify (P rows of a chain of D)")
    p.add_argument("--depth", type=cli_count(), default=6, help="D for --paths: nodes per row, root included")
    p.add_argument("--oracle", type=cli_oracle_points, nargs="?", const=cli_oracle_points(ORACLE_POINTS),
                   help=f"speed at equal τ: D/A pairs (default {ORACLE_POINTS}); needs --reference-target")
    p.add_argument("--out", help="write the results as JSON here too (a new file, or a report this script wrote)")
    args = p.parse_args(argv)
    if args.reference_heads and not args.reference_target:
        p.error("--reference-heads needs --reference-target")
    if args.oracle and not args.reference_target:
        p.error("--oracle needs --reference-target (the attention target the hybrids' speedups are compared with)")
    if args.out:  # a folder or someone else's file: refused now, not after the run
        args.out = claim_report_file(args.out, json_with_keys(*REPORT_KEYS), "rollback benchmark report")
    return args


def bench_prompts(tokenizer, count: int, max_new_tokens: int) -> list:
    """``count`` prompts (1, 128): the held-out code continuations ``scripts/benchmark.py`` runs by default."""
    import torch

    from draftsmith.data.corpus import continuation_prompts

    return [torch.tensor([ids]) for ids in continuation_prompts(tokenizer, count, 128, max_new_tokens)]


def random_prompts(vocab: int, count: int, length: int = 128) -> list:
    """``count`` prompts (1, ``length``) of random ids (for random targets: no tokenizer)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (1, length), generator=gen) for _ in range(count)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_model(name: str, hybrid: bool):
    """A target by name (``random:<kind>`` builds one of demo:tiny's size), checked: a hybrid target must keep
    a recurrent state draftsmith can decode (one line otherwise: an attention-only or attention-free model)."""
    from draftsmith.target.recurrent import check_supported, is_hybrid

    if name in RANDOM_TARGETS:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        model_type, extra = RANDOM_TARGETS[name]
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, **_DEMO, **extra)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
        model.generation_config.eos_token_id = None  # random text: no early stop
    else:
        from draftsmith.data.targets import load_target, load_target_config, resolve_target

        path = resolve_target(name)
        check_supported(load_target_config(path))  # a refused family, from its config: before the weights load
        model = load_target(path, dtype="auto", attn_implementation="sdpa").eval()
    if hybrid and not is_hybrid(model):
        raise ValueError(f"{name} ({type(model).__name__}) keeps no recurrent state: nothing to roll back")
    check_supported(model)  # an attention-free or untested stateful model, in one line
    return model


def _stats(gen, out, ref) -> dict:
    """One ``generate``'s numbers (``gen.last_stats``, profiled)."""
    import torch

    s = gen.last_stats
    return {"seconds": s.wall_time, "tokens": s.new_tokens, "steps": s.steps, "step_tokens": s.step_tokens,
            "verified": s.verified_tokens, "replays": s.replays, "replayed": s.replayed_tokens,
            "pending": s.pending_tokens, "verify_s": s.phase_times.get("verify", 0.0),
            "rollback_s": s.phase_times.get("rollback", 0.0), "phases": dict(s.phase_times),
            "identical": torch.equal(out, ref)}


def _summary(runs: list[dict], plain_s_per_token: float) -> dict:
    """One method's totals over its runs (each the stats of one ``generate``)."""
    total = {k: sum(r[k] for r in runs) for k in ("seconds", "tokens", "steps", "step_tokens", "verified",
                                                   "replays", "replayed", "pending", "verify_s", "rollback_s")}
    steps = max(total["steps"], 1)
    phases = {name: sum(r["phases"].get(name, 0.0) for r in runs) for name in runs[0]["phases"]}
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
        # each phase's time per step in plain decoding's time per token, t(1)
        "phase_per_step_over_t1": {k: round(v / steps / plain_s_per_token, 3) for k, v in phases.items()},
    }


def decode_in_turn(groups: dict, prompts: list, max_new_tokens: int) -> dict:
    """Every group's (model, {name: generator}) plain decoding and methods on each prompt in turn, after one
    warm-up of each; an oracle drafter (``seq``) is given the plain output first. {group: {name: summary}} and
    each group's plain tokens/s under "plain"."""
    import torch

    def plain(model, ids):
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=0)

    def methods(gens: dict, ids, ref, record=None):
        for name, gen in gens.items():
            if hasattr(gen.drafter, "seq"):
                gen.drafter.seq, gen.drafter.prompt_len = ref[0], ids.shape[1]
            out = gen.generate(ids, max_new_tokens=max_new_tokens)
            if record is not None:
                record[name].append(_stats(gen, out, ref))

    with torch.inference_mode():  # warm-up: first calls allocate caches and pick kernels
        for model, gens in groups.values():
            methods(gens, prompts[0], plain(model, prompts[0]))
    runs = {g: {name: [] for name in gens} for g, (_, gens) in groups.items()}
    plain_s, plain_tokens = dict.fromkeys(groups, 0.0), dict.fromkeys(groups, 0)
    for ids in prompts:
        for g, (model, gens) in groups.items():
            with torch.inference_mode():
                start = time.perf_counter()
                ref = plain(model, ids)
                plain_s[g] += time.perf_counter() - start
                plain_tokens[g] += ref.shape[1] - ids.shape[1]
            methods(gens, ids, ref, runs[g])
    return {g: {"plain": round(plain_tokens[g] / plain_s[g], 2),
                **{name: _summary(r, plain_s[g] / plain_tokens[g]) for name, r in runs[g].items()}} for g in groups}


def time_verify(timers: dict, ids, repeats: int) -> dict:
    """t(N): a verify of a chain of N after ``ids``' prefill (the same slots every time), each generator in
    turn for every N and repeat; {who: {N: median seconds}}."""
    import torch

    from draftsmith.infer.drafters import chain_draft

    samples = {(who, n): [] for who in timers for n in SIZES}
    with torch.inference_mode():
        for _ in range(repeats):
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
    return {who: {n: statistics.median(samples[(who, n)]) for n in SIZES} for who in timers}


def time_paths(gen, ids, paths: list[int], depth: int, repeats: int) -> dict:
    """t(P, D): P rows after the same prompt, each verifying a chain of D; {P: median seconds}."""
    import torch

    from draftsmith.infer.drafters import chain_draft

    t_paths = {}
    with torch.inference_mode():
        for count in sorted(set(paths) | {1}):
            out = gen.prefill(ids.expand(count, -1), 64)
            before = out.past_key_values.states.checkpoint()
            drafts = [chain_draft([ids[0, -1]] * depth, [])] * count
            samples = []
            for _ in range(repeats):
                out.past_key_values.states.restore(before)
                samples.append(timed(lambda: gen.verify(out.past_key_values, drafts)))
            t_paths[count] = statistics.median(samples)
    return t_paths


def _generator(model, drafter, rule: str = "per-token", **options):
    from draftsmith.infer import SpeculativeGenerator

    # "chunked": the Gated DeltaNet rule off (its chunked rule on every multi-token forward); what exactness needs stays
    return SpeculativeGenerator(model, drafter, per_token=rule != "chunked", **options)


def _ms(times: dict) -> dict:
    return {n: round(1000 * v, 3) for n, v in times.items()}


def _ratios(times: dict) -> dict:
    return {n: round(v / times[1], 3) for n, v in times.items()}


def rollback_bench(args, command: str) -> dict:
    """Measurements 1-3 (the module's doc): the rollbacks next to plain decoding, t(N), t(P, D)."""
    from draftsmith.data.targets import load_target_tokenizer, resolve_target
    from draftsmith.heads import AutoHead
    from draftsmith.infer.drafters.free.ngram import NgramDrafter

    target = load_model(args.target, hybrid=True)
    drafters = {"ngram": NgramDrafter}  # a fresh drafter per generator: no state shared between methods
    drafters.update({h: (lambda h=h: AutoHead.from_pretrained(h).eval()) for h in args.heads})
    methods = {f"{name}:{mode}" + (f":{rule}" if len(args.rules) > 1 else ""):
               _generator(target, make(), rule, rollback=mode, profile=True)
               for name, make in drafters.items() for mode in args.rollback for rule in args.rules}
    prompts = bench_prompts(load_target_tokenizer(resolve_target(args.target)), args.prompts, args.max_new_tokens)
    groups = {"target": (target, methods)}
    timers = {rule: _generator(target, NgramDrafter(), rule) for rule in args.rules}
    if args.reference_target:  # an attention target decoded beside the hybrid, prompt by prompt in turn
        reference = load_model(args.reference_target, hybrid=False)
        made = {"ngram": NgramDrafter, **{h: (lambda h=h: AutoHead.from_pretrained(h).eval()) for h in args.reference_heads}}
        groups["reference"] = (reference, {name: _generator(reference, make(), profile=True) for name, make in made.items()})
        timers[args.reference_target] = _generator(reference, NgramDrafter())
    results = decode_in_turn(groups, prompts, args.max_new_tokens)
    t_by = time_verify(timers, prompts[0], args.repeats)
    t = t_by[args.rules[0]]
    result = {"target": args.target, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "command": command,
              "plain_tokens_per_s": results["target"].pop("plain"), "methods": results["target"],
              "t_verify_ms": _ms(t), "t_N_over_t_1": _ratios(t)}
    if args.reference_target:
        result["reference"] = {"target": args.reference_target, "plain_tokens_per_s": results["reference"].pop("plain"),
                               "methods": results["reference"]}
    if len(t_by) > 1:
        result["t_verify_ms_by"] = {who: _ms(tw) for who, tw in t_by.items()}
        result["t_N_over_t_1_by"] = {who: _ratios(tw) for who, tw in t_by.items()}
    if args.paths:
        t_paths = time_paths(next(iter(methods.values())), prompts[0], args.paths, args.depth, args.repeats)
        result["t_paths_ms"], result["t_paths_over_t_1_path"] = _ms(t_paths), _ratios(t_paths)
    return result


def oracle_bench(args, command: str) -> dict:
    """Measurement 4 (the module's doc): speed at equal τ, each hybrid against the reference."""
    from draftsmith.data.targets import load_target_tokenizer, resolve_target

    names = [n.strip() for n in args.target.split(",") if n.strip()]
    models = {name: load_model(name, hybrid=True) for name in names}
    models[args.reference_target] = load_model(args.reference_target, hybrid=False)
    vocab = min(m.get_output_embeddings().weight.shape[0] for m in models.values())
    real = next((n for n in models if n not in RANDOM_TARGETS), None)
    prompts = random_prompts(vocab, args.prompts) if real is None else \
        bench_prompts(load_target_tokenizer(resolve_target(real)), args.prompts, args.max_new_tokens)

    rollback = {"rollback": args.rollback[0]} if len(args.rollback) == 1 else {}  # one asked for: the hybrids'
    groups = {name: (model, {f"D{d}/A{a}": _generator(model, partly_right(d, a, vocab), profile=True,
                                                      **(rollback if name in names else {}))
                             for d, a in args.oracle}) for name, model in models.items()}
    results = decode_in_turn(groups, prompts, args.max_new_tokens)
    t_by = time_verify({name: _generator(model, partly_right(1, 0, vocab)) for name, model in models.items()},
                       prompts[0], args.repeats)
    reference = results[args.reference_target]
    points = {}
    for d, a in args.oracle:
        key = f"D{d}/A{a}"
        points[key] = {name: {**results[name][key], "speedup_over_reference":
                              round(results[name][key]["speedup"] / reference[key]["speedup"], 3)} for name in names}
        points[key]["reference"] = reference[key]
    return {"target": args.target, "reference_target": args.reference_target, "command": command,
            "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "plain_tokens_per_s": {name: results[name]["plain"] for name in models}, "oracle": points,
            "t_N_over_t_1": {name: _ratios(t) for name, t in t_by.items()}, "t_verify_ms": {n: _ms(t) for n, t in t_by.items()}}


def partly_right(depth: int, right: int, vocab: int):
    """A drafter right for the first ``right`` of ``depth`` drafted tokens at every step."""
    return _partly_right_class()(depth, right, vocab)


@functools.cache
def _partly_right_class():  # built on first use: torch and infer load only after the arguments
    import torch

    from draftsmith.infer.bench.oracle import OracleDrafter
    from draftsmith.infer.drafters import Draft

    class Partly(OracleDrafter):
        """``OracleDrafter`` (its ``seq`` set to plain decoding's output per prompt) whose chain of ``depth`` is
        right for its first ``right`` tokens and wrong after: every step accepts ``right`` (τ = right + 1)."""

        def __init__(self, depth: int, right: int, vocab: int) -> None:
            super().__init__(torch.zeros(1, dtype=torch.long), 0, depth, vocab)
            self.right = right

        def _propose(self, pos, root, max_depth):
            draft = super()._propose(pos, root, max_depth)
            tokens = draft.tokens.clone()
            tokens[1 + self.right:] = (tokens[1 + self.right:] + 1) % self.vocab_size
            return Draft(tokens, draft.tree)

    return Partly


OTHER_PHASES = ("draft", "accept", "observe", "emit", "compact")


def _phases(method: dict) -> tuple[float, float, float]:
    """(verify, rollback, the other phases) per step over t(1)."""
    phases = method["phase_per_step_over_t1"]
    return phases.get("verify", 0.0), phases.get("rollback", 0.0), sum(phases.get(k, 0.0) for k in OTHER_PHASES)


def oracle_table(result: dict) -> str:
    """The equal-τ result as a markdown table (per step over t(1): the hybrid's, the reference's in brackets)."""
    rows = ["| D/A | target | τ | speedup | reference's | hybrid / reference | rollback share | verify / t(1) | "
            "rollback / t(1) | other phases / t(1) |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, point in result["oracle"].items():
        ref = point["reference"]
        ref_verify, _, ref_other = _phases(ref)
        for name, m in point.items():
            if name != "reference":
                verify, rollback, other = _phases(m)
                rows.append(f"| {key} | {name} | {m['tau']} | {m['speedup']} | {ref['speedup']} | "
                            f"**{m['speedup_over_reference']}** | {100 * m['rollback_share_of_step_time']:.1f}% | "
                            f"{verify:.2f} ({ref_verify:.2f}) | {rollback:.2f} | {other:.2f} ({ref_other:.2f}) |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # argument mistakes (and an --out that may not be written) end here, before torch loads
    import torch

    from draftsmith.target.threads import choose_threads

    print(choose_threads(args.threads), file=sys.stderr, flush=True)
    command = " ".join(["python lab/bench_rollback.py", *(sys.argv[1:] if argv is None else argv)])
    result = oracle_bench(args, command) if args.oracle else rollback_bench(args, command)
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result, indent=2))
    if args.oracle:
        print(oracle_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes (a missing target, a model it cannot decode, an --out it may not write) as
    one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
