"""Issue 55's MTP gates on demo:tiny-mtp: real τ of the target's native MTP layer, of MTP heads fine-tuned from it
and of EAGLE-3 heads of the same training budget; then our decoding with the native layer against transformers'
own MTP decoding (``generate(use_mtp=True)``) of the same weights, in tokens/s.

    python lab/mtp_gate.py --mtp runs/demo-tiny-mtp [...] --eagle3 runs/demo-tiny-mtp-eagle3 [...]
        [--target demo:tiny-mtp] [--prompts 24] [--max-new-tokens 128] [--prompt-tokens 32]
        [--speed-prompts 8] [--speed-rounds 3] [--out F]

τ: every drafter decodes the same held-out stdlib prompts (``data.corpus.continuation_prompts``, as
``scripts/rank_heads.py``) greedily with ``SpeculativeGenerator``'s default draft shape (on CPU the adaptive
chain), one prompt at a time, the drafters interleaved per prompt; τ = the verification steps' tokens over the
steps, pooled; every decode is checked against the target's own greedy ``generate``. The native drafter is
``build_head("mtp", target)`` (``head.init=native``: the checkpoint's ``mtp.*`` tensors).

Speed: per round and prompt, interleaved: transformers' ``generate(use_mtp=True)`` (its MTPCandidateGenerator
loads the MTP layer from the checkpoint on every call: that load is timed apart and reported with and without),
then ours with the same native layer as the default (adaptive) chain, fixed chains of 1 (transformers' shape) and
2, the CPU dynamic tree, a tree of the root's two best children and the CPU dynamic tree with each step's depth
chosen for tokens/s (``chosen_tree``), after one untimed call of each. Outputs must be transformers' own. Ratios
are of pooled tokens/s.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.data.base.checks import cli_count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="demo:tiny-mtp")
    p.add_argument("--mtp", nargs="*", type=Path, default=[], help="fine-tuned MTP heads (runs), one per seed")
    p.add_argument("--eagle3", nargs="*", type=Path, default=[], help="EAGLE-3 heads of the same budget, one per seed")
    p.add_argument("--prompts", type=cli_count(), default=24)
    p.add_argument("--max-new-tokens", type=cli_count(), default=128)
    p.add_argument("--prompt-tokens", type=cli_count(), default=32)
    p.add_argument("--speed-prompts", type=cli_count(0), default=8, help="0: no speed comparison")
    p.add_argument("--speed-rounds", type=cli_count(), default=3)
    p.add_argument("--threads", type=cli_count(), default=1,
                   help="torch threads (1, as README's --compare: two threads on a busy box slowed ours 3x)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def tau_rows(target, drafters: dict, prompts, references, max_new_tokens: int) -> list[dict]:
    """Per drafter: pooled real τ over the prompts (interleaved) and whether every output was the target's."""
    import torch

    from draftsmith.infer import SpeculativeGenerator

    gens = {name: SpeculativeGenerator(target, head) for name, head in drafters.items()}
    counts = {name: [0, 0, True] for name in gens}  # tokens, steps, identical
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        for name, gen in gens.items():
            with torch.inference_mode():
                out = gen.generate(prompt, max_new_tokens=max_new_tokens)
            c = counts[name]
            c[0], c[1] = c[0] + gen.last_stats.step_tokens, c[1] + gen.last_stats.steps
            c[2] &= bool(out.shape == reference.shape and (out == reference).all())
        print(f"prompt {i}: " + " | ".join(f"{n} {c[0] / c[1]:.3f}" for n, c in counts.items()), flush=True)
    return [{"drafter": n, "real_tau": c[0] / c[1], "tokens": c[0], "steps": c[1], "identical": c[2]}
            for n, c in counts.items()]


def speed_rows(target, native, prompts, max_new_tokens: int, rounds: int) -> dict:
    """Tokens/s of transformers' MTP decoding and of ours (chain, tree) with the same native layer, interleaved."""
    import torch
    from transformers.modeling_layers import MtpModel

    from draftsmith.infer import SpeculativeGenerator
    from draftsmith.infer.drafters.mtp import MtpDrafter

    from draftsmith.infer import Chain, DynamicTree
    from draftsmith.infer.drafters import chosen_tree

    ours = {"ours-chain": SpeculativeGenerator(target, native),  # the CPU default: a chain that adapts its length
            "ours-chain1": SpeculativeGenerator(target, native, tree=Chain(1)),  # transformers' shape (one layer)
            "ours-chain2": SpeculativeGenerator(target, native, tree=Chain(2)),
            "ours-tree": SpeculativeGenerator(target, native, tree=MtpDrafter.branching_tree(torch.device("cpu"))),
            # the root's two most likely children only: what a layer keeping ~40% of its first drafts pays for
            "ours-tree-1x2": SpeculativeGenerator(target, native, tree=DynamicTree(depth=1, top_k=2, total_tokens=3)),
            # the CPU dynamic tree with each step's depth chosen for tokens/s (0 to 5, infer.drafters.free.chooser)
            "ours-tree-chosen": SpeculativeGenerator(target, chosen_tree(native, target))}
    with torch.inference_mode():  # first calls (and the chosen tree's step-cost profile) are not timed
        target.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]), do_sample=False, max_new_tokens=8,
                        use_mtp=True)
        for gen in ours.values():
            gen.generate(prompts[0], max_new_tokens=8)
    seconds = {"transformers-use_mtp": 0.0, "mtp-load": 0.0, **{k: 0.0 for k in ours}}
    tokens, identical, steps = 0, {k: True for k in ours}, {k: [0, 0] for k in ours}
    for _ in range(rounds):
        for prompt in prompts:
            with torch.inference_mode():
                start = time.perf_counter()
                want = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                       max_new_tokens=max_new_tokens, use_mtp=True)
                seconds["transformers-use_mtp"] += time.perf_counter() - start
                start = time.perf_counter()
                MtpModel.from_pretrained(target)  # what each use_mtp call loads first
                seconds["mtp-load"] += time.perf_counter() - start
                for name, gen in ours.items():
                    start = time.perf_counter()
                    out = gen.generate(prompt, max_new_tokens=max_new_tokens)
                    seconds[name] += time.perf_counter() - start
                    identical[name] &= bool(out.shape == want.shape and (out == want).all())
                    steps[name][0] += gen.last_stats.step_tokens
                    steps[name][1] += gen.last_stats.steps
            tokens += want.shape[1] - prompt.shape[1]
    hf, hf_no_load = seconds["transformers-use_mtp"], seconds["transformers-use_mtp"] - seconds["mtp-load"]
    rows = {"transformers-use_mtp": {"tokens_per_s": tokens / hf, "tokens_per_s_without_load": tokens / hf_no_load}}
    for name in ours:
        rows[name] = {"tokens_per_s": tokens / seconds[name], "ratio": hf / seconds[name],
                      "ratio_without_load": hf_no_load / seconds[name], "identical": identical[name],
                      "real_tau": steps[name][0] / steps[name][1]}
    return {"rows": rows, "seconds": seconds, "tokens": tokens, "rounds": rounds, "prompts": len(prompts)}


def load_all(args: argparse.Namespace):
    """(target, drafters by name, prompts, the target's greedy references)."""
    import torch

    from draftsmith.data.corpus import continuation_prompts
    from draftsmith.data.targets import load_target, load_target_tokenizer, resolve_target
    from draftsmith.heads import build_head
    from draftsmith.scripts.rank_heads import load_head

    path = resolve_target(args.target)
    target = load_target(path, attn_implementation="sdpa").eval()
    tokenizer = load_target_tokenizer(path)
    scratch = Path(tempfile.mkdtemp())
    drafters = {"native-mtp": build_head("mtp", target).eval()}
    drafters.update({f"mtp:{run}": load_head(run, scratch) for run in args.mtp})
    drafters.update({f"eagle3:{run}": load_head(run, scratch) for run in args.eagle3})
    prompts = [torch.tensor(p)[None] for p in
               continuation_prompts(tokenizer, args.prompts, args.prompt_tokens, args.max_new_tokens)]
    with torch.inference_mode():
        references = [target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=args.max_new_tokens,
                                      do_sample=False) for p in prompts]
    return target, drafters, prompts, references


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from draftsmith.target.threads import choose_threads

    print(choose_threads(args.threads), flush=True)
    target, drafters, prompts, references = load_all(args)
    rows = tau_rows(target, drafters, prompts, references, args.max_new_tokens)
    native = rows[0]["real_tau"]
    for r in rows:
        r["vs_native"] = r["real_tau"] / native
        print(f"{r['drafter']}: real τ {r['real_tau']:.3f} ({r['vs_native']:.3f}x native) identical {r['identical']}")
    report = {"tau": rows, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens}
    if args.speed_prompts:
        report["speed"] = speed_rows(target, drafters["native-mtp"], prompts[:args.speed_prompts],
                                     args.max_new_tokens, args.speed_rounds)
        for name, row in report["speed"]["rows"].items():
            print(f"{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
