"""Every decoding method on one target, the same prompts, the same run — against the physical bound.

    python scripts/benchmark.py --target DIR --heads HEAD_DIR [HEAD_DIR ...] [--assistant DIR]
        [--prompts FILE.jsonl] [--num-prompts 8] [--max-new-tokens 128] [--trees tree,chain4]
        [--adaptive] [--profile] [--train-throughput] [--out DIR]

Methods: vanilla greedy ``generate`` (eager, DynamicCache); ``hf-static``: HF ``generate`` with
``cache_implementation="static"`` (HF compiles it on CUDA: the vanilla baseline that counts on a
GPU; ``--no-hf-static`` skips it); HF assisted generation (``--assistant``, a small LM sharing
the tokenizer) next to our draft-model drafter with the same LM (a chain of 4, and adaptive); HF
prompt-lookup decoding (unless ``--no-prompt-lookup``) next to our n-gram drafter (chain, tree of
3 matches, adaptive); with ``--adaptive`` each head also drafts an adaptive-length chain; each head with every
tree in ``--trees``: ``tree`` (the kind's tree-shaped default for the device: Medusa's static tree,
an EAGLE-2 dynamic tree), ``default`` (what a generator drafts when given no tree), ``chainN``,
``dynD-K-N`` (EAGLE: DynamicTree(depth=D, top_k=K, total_tokens=N)), ``medusaN`` (the first N
nodes of mc_sim_7b_63); a tree that does not fit a head's kind is skipped. Per method: median tokens/s over prompts
and repeats (after warm-up), speedup over vanilla, τ (tokens per verification forward), the mean
number of tokens each verification forward carried, peak memory (CUDA only), and whether the
greedy output is identical to vanilla's. Speedups are reported against vanilla and against
hf-static. Heads run with ``--cache-implementation`` and ``--compile`` (default: the device's, see
``infer.generator.default_decode_settings``); on the static path t(N) is the compiled verify step's.

The bound: a verification forward over N tokens costs t(N) on this hardware; a method with
acceptance τ verifying N tokens per step can at best be τ·t(1)/t(N) times faster than vanilla
(drafting for free). efficiency = measured speedup / bound says how much of that we keep.

``--profile`` adds where a speculative step's time goes per head method (draft, observe, verify,
accept, compact, emit). ``--train-throughput`` adds head-training tokens/s against the target's
forward-only tokens/s. Writes results.json, results.md and PNG plots to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_scale, beside this script

from data.base.device import default_device, sync  # noqa: E402
from heads import AutoHead  # noqa: E402
from infer import Chain, DynamicTree, SpeculativeGenerator, StaticTree  # noqa: E402
from infer.drafters import TreeOption, default_branching_tree, default_tree  # noqa: E402
from infer.adaptive import AdaptiveLength  # noqa: E402
from infer.cache import keep_accepted  # noqa: E402
from infer.drafters import make_drafter  # noqa: E402
from infer.lm_drafter import LMDrafter  # noqa: E402
from infer.ngram import NgramDrafter  # noqa: E402
from infer.target import decoder_layers, target_forward  # noqa: E402
from infer.tree import MEDUSA_DEFAULT_CHOICES, tree_attention_mask, tree_from_parents  # noqa: E402


# ----------------------------------------------------------------------------------- prompts


def load_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Token-id prompts: a JSONL file of {"prompt": str} or {"messages": [...]}, else the demo
    corpus's held-out split (code continuation: the first ``--prompt-tokens`` tokens of a file chunk)."""
    prompts: list[list[int]] = []
    if args.prompts == "demo:mtbench":  # MT-bench first turns, categories interleaved (data.assets)
        from data.assets import mtbench_prompts

        for messages in mtbench_prompts():
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append(list(ids["input_ids"]))
    elif args.prompts:
        for line_no, line in enumerate(Path(args.prompts).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, Mapping) else ids  # a BatchEncoding is no dict
            elif "prompt" in row:
                ids = tokenizer(row["prompt"])["input_ids"]
            else:
                raise ValueError(f"{args.prompts}:{line_no}: a prompt row needs 'prompt' or 'messages', got {sorted(row)}")
            prompts.append(list(ids))
    else:
        from data.corpus import continuation_prompts

        prompts = continuation_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.max_new_tokens)
    if not prompts:
        raise ValueError("no prompts: the prompt file is empty or no held-out chunk is long enough")
    return prompts[: args.num_prompts]


# ----------------------------------------------------------------------------------- counting


class ForwardCounter:
    """Counts target forwards and their query lengths with a pre-hook on the first decoder layer."""

    def __init__(self, target) -> None:
        self.lengths: list[int] = []
        self._layer = decoder_layers(target)[0]
        self._handle = None
        self.enabled(True)

    def enabled(self, on: bool) -> None:
        """Hook on or off: off while a compiled method runs (a hook would be traced into its graph)."""
        if on and self._handle is None:
            self._handle = self._layer.register_forward_pre_hook(self._hook, with_kwargs=True)
        elif not on and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.lengths.append(int(hidden.shape[1]))

    def reset(self) -> None:
        self.lengths = []


# ----------------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str
    kind: str  # vanilla | assisted | prompt_lookup | head
    run: object  # callable(input_ids) -> output ids (1, P + new)
    runs: list[dict] = field(default_factory=list)
    generator: SpeculativeGenerator | None = None  # head methods: counts come from its stats
    compiled: bool = False  # runs a compiled graph: module hooks would not see its forwards


TREE_SPEC = re.compile(r"^(tree|default|chain(\d+)|dyn(\d+)-(\d+)-(\d+)|medusa(\d+))$")


def tree_from_spec(spec: str, head, device: torch.device) -> TreeOption | None:
    """The tree named by a ``--trees`` entry for this head, or None when it does not fit its kind."""
    match = TREE_SPEC.match(spec)
    if match is None:
        raise ValueError(f"--trees: unknown tree {spec!r}; use tree, default, chainN, dynD-K-N or medusaN")
    kind = head.head_kind
    if spec == "tree":
        return default_branching_tree(kind, device)
    if spec == "default":
        return default_tree(kind, device)
    chain, depth, top_k, total, medusa = match.group(2, 3, 4, 5, 6)
    if chain:
        fits = kind != "medusa" or int(chain) <= head.config.num_heads
        return Chain(int(chain)) if fits else None
    if depth:
        return DynamicTree(int(depth), int(top_k), int(total)) if kind != "medusa" else None
    return StaticTree(MEDUSA_DEFAULT_CHOICES[: int(medusa)]) if kind == "medusa" else None


def build_methods(args, target, tokenizer) -> list[Method]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    if args.ignore_eos:
        common["eos_token_id"] = None
    # HF reads an explicit eos_token_id=None as "no EOS"; SpeculativeGenerator reads None as "the
    # generation config's", as HF does by default: an empty list means no EOS for it.
    eos = [] if args.ignore_eos else None

    def hf(**extra):
        return lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), **common, **extra)

    def ours(name: str, kind: str, drafter) -> Method:
        gen = SpeculativeGenerator(target, drafter, tokenizer=tokenizer,
                                   cache_implementation=args.cache_implementation, compile=args.compile)
        run = lambda ids: gen.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)  # noqa: E731
        return Method(name, kind, run, generator=gen)

    methods = [Method("vanilla", "vanilla", hf())]
    if not args.no_hf_static:
        methods.append(Method("hf-static", "vanilla", hf(cache_implementation="static"), compiled=True))
    if args.assistant:
        assistant = AutoModelForCausalLM.from_pretrained(args.assistant, dtype=target.dtype).to(target.device).eval()
        methods.append(Method("hf-assisted", "assisted", hf(assistant_model=assistant)))
        # HF's assisted generation (transformers 5.x defaults): up to 20 drafts, a draft stops below
        # probability 0.4 (HF then tunes that threshold); ours: a chain of 4, and +2/-1 adaptive with the 0.4 stop.
        methods.append(ours("draft-lm:chain4", "draft_lm", LMDrafter(assistant, target, Chain(4))))
        methods.append(ours("draft-lm:adaptive", "draft_lm", AdaptiveLength(
            LMDrafter(assistant, target, Chain(20), confidence=0.4), initial=4, maximum=20)))
    if not args.no_prompt_lookup:
        methods.append(Method("hf-prompt-lookup", "prompt_lookup", hf(prompt_lookup_num_tokens=args.prompt_lookup_tokens)))
        # HF's prompt lookup: n-grams of 2 down to 1, prompt_lookup_num_tokens drafts, first match.
        length = args.prompt_lookup_tokens
        methods.append(ours("ngram:chain", "ngram", NgramDrafter(max_ngram=2, length=length)))
        methods.append(ours("ngram:tree3", "ngram", NgramDrafter(max_ngram=2, length=length, branches=3)))
        methods.append(ours("ngram:adaptive", "ngram", AdaptiveLength(NgramDrafter(max_ngram=2, length=length), initial=4, maximum=length)))
    for head_dir in args.heads:
        head = AutoHead.from_pretrained(head_dir).eval()
        label = Path(head_dir).name
        variants = [(spec, tree_from_spec(spec, head, target.device)) for spec in args.trees]
        for variant, tree in variants:
            if tree is None:
                continue
            gen = SpeculativeGenerator(target, head, tokenizer=tokenizer, tree=tree,
                                       cache_implementation=args.cache_implementation, compile=args.compile)
            run = (lambda g: lambda ids: g.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos))(gen)
            name = f"{head.head_kind}:{label}:{variant}" if len(args.heads) > 1 else f"{head.head_kind}:{variant}"
            methods.append(Method(name, "head", run, generator=gen))
        if args.adaptive:  # a chain whose length follows acceptance (Medusa: at most its head count)
            longest = head.config.num_heads if head.head_kind == "medusa" else 16
            drafter = AdaptiveLength(make_drafter(head, target, Chain(longest)), initial=min(4, longest), maximum=longest)
            name = f"{head.head_kind}:{label}:adaptive" if len(args.heads) > 1 else f"{head.head_kind}:adaptive"
            methods.append(ours(name, "head", drafter))
    return methods


def time_methods(methods: list[Method], prompts, args, target, counter: ForwardCounter) -> None:
    device = target.device
    total = len(methods) * len(prompts) * (args.warmup + args.repeats)
    bar = tqdm(total=total, desc="benchmark", unit="gen")
    for p_idx, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], device=device)
        for method in methods:  # interleaved per prompt: slow drifts hit every method alike
            counter.enabled(method.generator is None and not method.compiled)
            times = []
            for rep in range(args.warmup + args.repeats):
                counter.reset()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                sync(device)
                start = time.perf_counter()
                with torch.inference_mode():
                    out = method.run(ids)
                sync(device)
                elapsed = time.perf_counter() - start
                bar.update()
                if rep >= args.warmup:
                    times.append(elapsed)
            new = out[0, ids.shape[1]:].tolist()
            if method.generator is not None:  # the generator counts its own forwards
                stats = method.generator.last_stats
                forwards, verify_mean = stats.target_forwards, stats.verified_tokens / max(1, stats.steps)
            elif method.compiled:  # HF's static-cache generate: one forward per token
                forwards, verify_mean = len(new), 1.0
            else:
                verify = counter.lengths[1:]  # the first forward is the prefill
                forwards, verify_mean = len(counter.lengths), statistics.fmean(verify) if verify else 1.0
            method.runs.append({
                "prompt": p_idx,
                "new_tokens": len(new),
                "seconds": statistics.median(times),
                "forwards": forwards,
                "verify_lengths_mean": verify_mean,
                "tau": (len(new) - 1) / max(1, forwards - 1),
                "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
                "tokens": new,
            })
    bar.close()


# ----------------------------------------------------------------------------------- profile

LOOP_PHASES = ("draft", "observe", "verify", "accept", "compact", "emit")


def profile_heads(methods: list[Method], prompts, args, device: torch.device) -> dict[str, dict]:
    """Where a speculative step's time goes: one extra, untimed pass per head method with the
    generator's phase clock on (it syncs the device at each phase end). Milliseconds per step."""
    vanilla = methods[0]
    vanilla_ms = 1e3 * sum(r["seconds"] for r in vanilla.runs) / sum(r["new_tokens"] for r in vanilla.runs)
    profiles = {}
    heads = [m for m in methods if m.generator is not None]
    eos = [] if args.ignore_eos else None
    for m in tqdm(heads, desc="profile", unit="method"):
        gen = m.generator
        gen.profile = True
        totals: dict[str, float] = {}
        steps = new_tokens = 0
        try:
            for prompt in prompts:
                with torch.inference_mode():
                    gen.generate(torch.tensor([prompt], device=device), max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                stats = gen.last_stats
                for phase, seconds in stats.phase_times.items():
                    totals[phase] = totals.get(phase, 0.0) + seconds
                steps += stats.steps
                new_tokens += stats.new_tokens
        finally:
            gen.profile = False
        per_step = {phase: 1e3 * totals.get(phase, 0.0) / max(1, steps) for phase in LOOP_PHASES}
        step_ms = sum(per_step.values())
        profiles[m.name] = {
            "ms_per_step": per_step,
            "step_ms": step_ms,
            "steps": steps,
            "tokens_per_step": (new_tokens - len(prompts)) / max(1, steps),  # the prefill emits one each
            "drafting_share": (per_step["draft"] + per_step["observe"]) / step_ms if step_ms else 0.0,
            "vanilla_ms_per_token": vanilla_ms,
        }
    return profiles


def profile_markdown(profiles: dict[str, dict]) -> str:
    lines = ["Where a step's time goes (ms per verification step, one profiled pass; drafting = draft + observe):", "",
             "| method | " + " | ".join(LOOP_PHASES) + " | step | tokens/step | ms/token | vanilla ms/token | drafting |",
             "|---|" + "---:|" * (len(LOOP_PHASES) + 5)]
    for name, p in profiles.items():
        cells = " | ".join(f"{p['ms_per_step'][phase]:.2f}" for phase in LOOP_PHASES)
        per_token = p["step_ms"] / p["tokens_per_step"] if p["tokens_per_step"] else float("nan")
        lines.append(f"| {name} | {cells} | {p['step_ms']:.2f} | {p['tokens_per_step']:.2f} | {per_token:.2f} | "
                     f"{p['vanilla_ms_per_token']:.2f} | {p['drafting_share']:.0%} |")
    return "\n".join(lines) + "\n"


def plot_profile(profiles: dict[str, dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(profiles)
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(names) + 2.2))
    left = [0.0] * len(names)
    for phase in LOOP_PHASES:
        widths = [profiles[n]["ms_per_step"][phase] for n in names]
        ax.barh(names, widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    vanilla = next(iter(profiles.values()))["vanilla_ms_per_token"]
    ax.axvline(vanilla, color="black", ls="--", lw=1, label="vanilla: one token")
    ax.set_xlabel("milliseconds per verification step")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, ncol=4, frameon=False)
    ax.set_title("where a speculative step's time goes")
    fig.tight_layout()
    fig.savefig(out / "profile.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------- the bound


def verification_cost(target, prompt: list[int], sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one target forward over an N-token tree after a cached prompt, per N.

    Sizes are interleaved within each repeat (round robin), so a slow spell of a shared machine
    hits every N alike instead of bending the curve.
    """
    device = target.device
    cache = DynamicCache()
    ids = torch.tensor([prompt], device=device)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        target_forward(target, ids, past_key_values=cache, use_cache=True, compute_logits=False)
        prefix = ids.shape[1]
        inputs = {}
        for n in sizes:
            # a bushy tree (root + children under the first few nodes); cost depends on N, not shape
            tree = tree_from_parents([-1] + [(i - 1) // 4 for i in range(1, n)], device)
            inputs[n] = dict(attention_mask=tree_attention_mask(tree.mask, prefix, target.dtype),
                             position_ids=(prefix + tree.depths)[None],
                             tokens=torch.tensor([prompt[-1]] * n, device=device)[None])
        for rep in tqdm(range(repeats + 1), desc="verification cost t(N)", unit="round"):
            for n in sizes:
                x = inputs[n]
                sync(device)
                start = time.perf_counter()
                target_forward(target, x["tokens"], attention_mask=x["attention_mask"],
                               position_ids=x["position_ids"], past_key_values=cache, use_cache=True)
                sync(device)
                if rep:  # the first round is warm-up
                    times[n].append(time.perf_counter() - start)
                keep_accepted(cache, prefix, torch.empty(0, dtype=torch.long, device=device))
    return {n: statistics.median(times[n]) for n in sizes}


def static_verification_cost(target, prompt: list[int], sizes: list[int], args, compile) -> dict[int, float]:
    """t(N) of the static (compiled when ``compile``) verify step, per N, interleaved."""
    from bench_scale import OracleDrafter, verify_costs

    ids = torch.tensor([prompt], device=target.device)
    vocab = target.config.get_text_config().vocab_size
    gens = {n: SpeculativeGenerator(target, OracleDrafter(ids[0], len(prompt), n - 1, vocab),
                                    cache_implementation="static", compile=compile) for n in sizes}
    return verify_costs(sizes, ids, gens, args.max_new_tokens, repeats=max(30, 10 * args.repeats))


def cost_at(costs: dict[int, float], n: float) -> float:
    """t(n) by linear interpolation of the measured sweep."""
    sizes = sorted(costs)
    if n <= sizes[0]:
        return costs[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if n <= hi:
            return costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)
    return costs[sizes[-1]] * n / sizes[-1]


# ----------------------------------------------------------------------------------- report


def _speedups(m: Method, base: Method) -> list[float]:
    return [b["seconds"] / r["seconds"] * r["new_tokens"] / b["new_tokens"] for r, b in zip(m.runs, base.runs)]


def summarise(methods: list[Method], costs: dict[int, float]) -> list[dict]:
    vanilla = methods[0]
    static = next((m for m in methods if m.name == "hf-static"), None)
    rows = []
    for m in methods:
        tps = [r["new_tokens"] / r["seconds"] for r in m.runs]
        speedups = _speedups(m, vanilla)
        tau = statistics.fmean(r["tau"] for r in m.runs)
        n_verify = statistics.fmean(r["verify_lengths_mean"] for r in m.runs)
        bound = tau * costs[1] / cost_at(costs, n_verify)
        speedup = statistics.median(speedups)
        mem = [r["peak_mem_mb"] for r in m.runs if r["peak_mem_mb"] is not None]
        rows.append({
            "method": m.name,
            "tokens_per_s": statistics.median(tps),
            "speedup": speedup,
            "speedup_vs_hf_static": statistics.median(_speedups(m, static)) if static else None,
            "tau": tau,
            "forwards_per_token": statistics.fmean(r["forwards"] / max(1, r["new_tokens"]) for r in m.runs),
            "tokens_per_verify": n_verify,
            "bound": bound,
            "efficiency": speedup / bound if bound else float("nan"),
            "peak_mem_mb": max(mem) if mem else None,
            "identical": all(r["tokens"] == v["tokens"] for r, v in zip(m.runs, vanilla.runs)),
        })
    return rows


def markdown(rows: list[dict], costs: dict[int, float], meta: dict) -> str:
    lines = [
        f"Target `{meta['target']}` on {meta['hardware']}, {meta['dtype']}, {meta['num_prompts']} prompts × "
        f"{meta['repeats']} repeats, max_new_tokens={meta['max_new_tokens']}.",
        "",
        "| method | tokens/s | speedup | vs hf-static | τ | fwd/token | tokens/verify | bound | efficiency | peak MiB | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        mem = f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "–"
        vs_static = f"{r['speedup_vs_hf_static']:.2f}×" if r.get("speedup_vs_hf_static") else "–"
        lines.append(
            f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {vs_static} | {r['tau']:.2f} | "
            f"{r['forwards_per_token']:.2f} | {r['tokens_per_verify']:.1f} | {r['bound']:.2f}× | "
            f"{r['efficiency']:.0%} | {mem} | {'yes' if r['identical'] else 'NO'} |"
        )
    lines += ["", "Verification cost t(N) / t(1):", "",
              "| N | " + " | ".join(str(n) for n in costs) + " |",
              "|---|" + "---:|" * len(costs),
              "| t(N)/t(1) | " + " | ".join(f"{costs[n] / costs[1]:.2f}" for n in costs) + " |",
              "", f"t(1) = {costs[1] * 1e3:.2f} ms."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], costs: dict[int, float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.5))
    axes[0].barh(names, [r["speedup"] for r in rows], color="tab:blue", label="measured")
    axes[0].scatter([r["bound"] for r in rows], names, color="tab:red", marker="|", s=300, label="bound τ·t(1)/t(N)")
    axes[0].axvline(1.0, color="gray", lw=0.8)
    axes[0].set_xlabel("speedup over vanilla greedy")
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    axes[0].invert_yaxis()
    axes[1].barh(names, [r["tau"] for r in rows], color="tab:green")
    axes[1].set_xlabel("τ: tokens per verification forward")
    axes[1].set_yticklabels([])
    axes[1].invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "speedup_tau.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = sorted(costs)
    ax.plot(sizes, [costs[n] / costs[1] for n in sizes], marker="o")
    ax.plot(sizes, sizes, ls="--", color="gray", label="linear (t(N) = N·t(1))")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens verified in one forward (N)")
    ax.set_ylabel("t(N) / t(1)")
    ax.legend()
    ax.set_title("verification cost vs tree size")
    fig.tight_layout()
    fig.savefig(out / "verification_cost.png", dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model directory, hub id, demo:<size> or demo:smollm2")
    p.add_argument("--heads", nargs="*", default=[], help="trained head directories")
    p.add_argument("--assistant", help="small LM sharing the tokenizer, for HF assisted generation")
    p.add_argument("--prompts", help="JSONL with {'prompt': str} or {'messages': [...]} rows, or demo:mtbench")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for held-out corpus prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max_new_tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trees", default="tree,chain4",
                   help="comma-separated trees per head: tree, default, chainN, dynD-K-N, medusaN")
    p.add_argument("--no-prompt-lookup", action="store_true", help="skip HF prompt-lookup decoding")
    p.add_argument("--no-hf-static", action="store_true", help="skip HF generate with a static cache")
    p.add_argument("--cache-implementation", choices=("static", "dynamic"), default=None,
                   help="the heads' decode state (default: the device's)")
    p.add_argument("--compile", default=None, choices=("true", "false"),
                   help="compile the heads' static verify step (default: the device's)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10)
    p.add_argument("--adaptive", action="store_true", help="also run each head with an adaptive-length chain")
    p.add_argument("--tree-sizes", default="1,2,4,8,16,32,48,64,96,128")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--train-throughput", action="store_true", help="also measure head-training tokens/s")
    p.add_argument("--profile", action="store_true",
                   help="also time each phase of a speculative step per head method (an extra, untimed pass)")
    p.add_argument("--out", default="bench-out")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.num_prompts < 1:
        p.error("--repeats and --num-prompts must be >= 1")
    args.compile = None if args.compile is None else args.compile == "true"
    args.trees = [t.strip() for t in args.trees.split(",") if t.strip()]
    bad = [t for t in args.trees if not TREE_SPEC.match(t)]
    if bad or not args.trees:
        p.error(f"--trees: unknown tree(s) {bad}; use tree, default, chainN, dynD-K-N or medusaN")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = default_device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    from data.targets import resolve_target

    target_path = resolve_target(args.target)  # results keep the name given (demo:smollm2), not the cache path
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    prompts = load_prompts(args, tokenizer)
    sizes = sorted({int(s) for s in args.tree_sizes.split(",")} | {1})
    counter = ForwardCounter(target)
    methods = build_methods(args, target, tokenizer)
    static = [m.generator for m in methods if m.generator is not None and m.generator.cache_implementation == "static"]
    if static:  # t(N) of the step the heads really run: the (compiled) static verify
        counter.enabled(False)
        costs = static_verification_cost(target, prompts[0], sizes, args, static[0].compile)
    else:
        costs = verification_cost(target, prompts[0], sizes, repeats=max(30, 10 * args.repeats))
    time_methods(methods, prompts, args, target, counter)
    rows = summarise(methods, costs)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    meta = {
        "target": args.target, "heads": args.heads, "assistant": args.assistant, "hardware": hardware,
        "dtype": str(dtype).removeprefix("torch."), "num_prompts": len(prompts), "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens, "torch": torch.__version__, "command": " ".join(sys.argv),
    }
    result = {"meta": meta, "rows": rows, "verification_cost_s": costs,
              "runs": {m.name: m.runs for m in methods}}
    if args.profile:
        result["profile"] = profile_heads(methods, prompts, args, device)
    if args.train_throughput:
        from train.loop import measure_throughput, parse_args as train_args

        configs = Path(__file__).resolve().parents[1] / "configs"
        demo = {"medusa": "demo-medusa.yaml", "eagle": "demo-eagle.yaml", "eagle3": "demo.yaml"}
        result["train_throughput"] = {
            kind: measure_throughput(train_args([f"target={args.target}"], default_config=configs / name))
            for kind, name in tqdm(demo.items(), desc="training throughput")
        }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    table = markdown(rows, costs, meta)
    if "train_throughput" in result:
        table += "\nHead training throughput (tokens/s) vs the target's forward-only tokens/s:\n\n"
        table += "| head | train tokens/s | target forward tokens/s | ratio |\n|---|---:|---:|---:|\n"
        for kind, r in result["train_throughput"].items():
            table += f"| {kind} | {r['train_tokens_per_s']:.0f} | {r['target_forward_tokens_per_s']:.0f} | {r['ratio']:.2f} |\n"
    if result.get("profile"):
        table += "\n" + profile_markdown(result["profile"])
        plot_profile(result["profile"], out)
    (out / "results.md").write_text(table)
    plot(rows, costs, out)
    print(table)
    print(f"results in {out}/ (results.json, results.md, speedup_tau.png, verification_cost.png)")
    return result


if __name__ == "__main__":
    from data.cli import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
