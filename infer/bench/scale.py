"""Decoding speed at real model shapes with random weights and an oracle drafter (``scripts/bench_scale.py``).

Random weights make a near-flat next-token distribution, where a multi-token verify in bf16 can
round to a different argmax than one-token decoding. So the oracle aims at the generator's own
greedy path: start from HF's static-cache output, run the generator with the oracle, and repeat
with its output until the output stops changing (``fixpoint_rounds``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import transformers

from draftsmith.data.base.device import default_device
from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.infer.bench.cost import bound, verify_costs
from draftsmith.infer.bench.oracle import OracleDrafter
from draftsmith.infer.bench.shapes import build_target
from draftsmith.infer.bench.timing import peak_memory_mib, reset_peak_memory, timed
from draftsmith.infer.drafters import Sampling, drafter_class


def head_shapes(kind: str, chain: int) -> tuple:
    """(name, draft shape, compile) pairs a random head of ``kind`` is timed at: EAGLE-3 its eager and compiled
    chain of ``chain`` and the GPU's dynamic tree (depth 8, top-k 10, 60 nodes); DFlash its GPU block (15 drafts)."""
    if kind == "dflash":
        return (("block15", Chain(15), False), ("block15-compiled", Chain(15), True))
    tree = DynamicTree(depth=8, top_k=10, total_tokens=60)
    return (("chain", Chain(chain), False), ("chain-compiled", Chain(chain), True),
            ("dyn8-10-60", tree, False), ("dyn8-10-60-compiled", tree, True))


def head_draft_cost(target, args, device, dtype, kind: str = "eagle3", shapes: tuple | None = None) -> dict:
    """Seconds per draft of a random ``kind`` head of the target's dimensions, per draft shape (``head_shapes``
    by default; the generator's ``compile=True``: CUDA graphs on CUDA)."""
    cfg = target.config
    torch.manual_seed(0)
    options = {"draft_vocab_size": min(args.draft_vocab, cfg.vocab_size)} if kind == "eagle3" else {}
    head = build_head(kind, target, **options).to(device, dtype).eval()
    result = {}
    for name, tree, compile in shapes or head_shapes(kind, args.chain):
        drafter = drafter_class(kind)(head, target, tree)
        drafter.compile_with(compile)
        width = len(head.config.aux_layer_ids) * cfg.hidden_size  # the target states the head reads, concatenated
        features = torch.randn(1, args.prompt_tokens, width, device=device, dtype=dtype)
        tokens = torch.randint(3, cfg.vocab_size, (1, args.prompt_tokens), device=device)
        states = drafter.new_rows([tokens], [args.prompt_tokens + args.max_new_tokens])  # a batch of one
        with torch.inference_mode():
            drafter.observe_rows(states, [features], [tokens])
            roots = [tokens[0, -1]]
            seconds, _ = timed(lambda: drafter.propose_rows(states, roots, Sampling(), [64]), 3, args.cost_repeats)
        result[name] = seconds
    return result


DECODES = {"eager": False, "compiled": True}  # the one switch of the one decode path



def compare_decodes(target, prompts, hf_out, args) -> dict:
    """ms/token of the oracle chain under each decode state, timed round-robin (one run of each
    mode in turn, ``--repeats`` rounds after a warm-up round), so a busy host slows every mode alike.
    This is how the per-device default (``default_compile``) was chosen."""
    vocab = target.config.vocab_size
    times: dict[str, list[float]] = {mode: [] for mode in DECODES}
    taus: dict[str, list[float]] = {mode: [] for mode in DECODES}
    for p, ref in zip(prompts, hf_out):
        oracle = OracleDrafter(ref[0], p.shape[1], args.chain, vocab)
        gens = {mode: SpeculativeGenerator(target, oracle, compile=comp) for mode, comp in DECODES.items()}
        for rnd in range(args.repeats + 1):
            for mode, gen in gens.items():
                with torch.inference_mode():
                    seconds, _ = timed(lambda: gen.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=[]), 0, 1)
                if rnd:
                    times[mode].append(seconds / args.max_new_tokens)
                    taus[mode].append(gen.last_stats.tau)
    return {mode: {"ms_per_token": 1e3 * statistics.median(t), "tau": statistics.fmean(taus[mode])}
            for mode, t in times.items()}


class Rows:
    """Result rows keyed by method name, printed as they come."""

    def __init__(self, max_new_tokens: int) -> None:
        self.max_new_tokens = max_new_tokens
        self.rows: dict[str, dict] = {}

    def record(self, name: str, seconds: list[float], taus: list[float] | None = None, compile_s: float | None = None,
               peak_mib: float | None = None, identical: float | None = None) -> dict:
        per_tok = statistics.median(s / self.max_new_tokens for s in seconds)
        row = self.rows[name] = {
            "ms_per_token": 1e3 * per_tok, "tokens_per_s": 1 / per_tok, "tau": statistics.fmean(taus) if taus else 1.0,
            "compile_s": compile_s, "peak_mem_gib": peak_mib / 1024 if peak_mib is not None else None,
            "identical_to_hf_static": identical}
        print(f"{name:>24}: {1e3 * per_tok:7.2f} ms/token  {1 / per_tok:7.1f} tok/s"
              + (f"  tau {row['tau']:.2f}" if taus else ""), flush=True)
        return row


def hf_baselines(target, prompts: list[torch.Tensor], args: argparse.Namespace, rows: Rows) -> list[torch.Tensor]:
    """HF eager (unless skipped) and static-cache ``generate``; returns the static outputs."""
    device = target.device
    hf_kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    with torch.inference_mode():
        if not args.skip_hf_eager:
            reset_peak_memory(device)
            secs = [timed(lambda p=p: target.generate(p, **hf_kw), 1, args.repeats)[0] for p in prompts]
            rows.record("hf-eager", secs, peak_mib=peak_memory_mib(device))
        reset_peak_memory(device)
        start = time.perf_counter()
        target.generate(prompts[0], cache_implementation="static", **hf_kw)  # compiles
        hf_compile = time.perf_counter() - start
        hf_out, secs = [], []
        for p in prompts:
            s, out = timed(lambda p=p: target.generate(p, cache_implementation="static", **hf_kw), 1, args.repeats)
            secs.append(s)
            hf_out.append(out)
        rows.record("hf-static", secs, compile_s=hf_compile, peak_mib=peak_memory_mib(device))
    return hf_out


def oracle_run(target, prompts, hf_out, args: argparse.Namespace, rows: Rows, nodes: int | None,
               compile_flag: bool, gen: SpeculativeGenerator | None = None,
               name: str | None = None) -> tuple[SpeculativeGenerator, list[int]]:
    """Our generator with the oracle as a chain (``nodes`` None) or a ``nodes``-node tree, after
    reaching the generator's own greedy fixed point per prompt; returns it and the rounds taken. ``gen``: a
    generator of the same budget to reuse (its compiled verify step), else a new one; ``name``: the row's."""
    vocab = target.config.vocab_size
    name = name or f"ours:oracle-{'chain' if nodes is None else 'tree'}{args.chain if nodes is None else nodes}"
    seconds, taus, identical, rounds = [], [], [], []
    reset_peak_memory(target.device)
    compile_s = 0.0
    for p, ref in zip(prompts, hf_out):
        seq = ref[0]
        for rnd in range(args.fixpoint_rounds):
            oracle = OracleDrafter(seq, p.shape[1], args.chain, vocab, nodes)
            if gen is None:
                gen = SpeculativeGenerator(target, oracle, compile=compile_flag)
            gen.drafter = oracle
            with torch.inference_mode():
                out = gen.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=[])
            compile_s += gen.last_stats.compile_time
            if torch.equal(out[0], seq):
                break
            seq = out[0]
        rounds.append(rnd + 1)
        with torch.inference_mode():
            s, out = timed(lambda: gen.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=[]), 1, args.repeats)
        seconds.append(s)
        taus.append(gen.last_stats.tau)
        identical.append(bool(torch.equal(out, ref)))
    row = rows.record(name, seconds, taus, compile_s=compile_s, peak_mib=peak_memory_mib(target.device),
                      identical=sum(identical) / len(identical))
    row["budget"] = gen.budget
    return gen, rounds


def add_bounds(rows: dict[str, dict], costs: dict[int, float]) -> None:
    """Speedup over one compiled forward per token, the bound tau*t(1)/t(N) and efficiency, per row."""
    t1 = costs[1]
    for row in rows.values():
        speedup = t1 / (row["ms_per_token"] / 1e3)
        limit = bound(row["tau"], costs, row.get("budget", 1))
        row.update(speedup_vs_t1=speedup, bound=limit, efficiency=speedup / limit,
                   speedup_vs_hf_static=rows["hf-static"]["ms_per_token"] / row["ms_per_token"])


def run_scale(args: argparse.Namespace) -> dict:
    """The whole model-shape benchmark (see ``scripts/bench_scale.py``)."""
    device = default_device(args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    target = build_target(args.shape, device, dtype, args.seed)
    print(f"built {args.shape} ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B params) in "
          f"{time.perf_counter() - t0:.1f} s on {device}", flush=True)
    seeded = torch.Generator().manual_seed(args.seed)
    vocab = target.config.vocab_size
    prompts = [torch.randint(3, vocab, (1, args.prompt_tokens), generator=seeded).to(device) for _ in range(args.num_prompts)]
    meta = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": args.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
            "prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
            "num_prompts": args.num_prompts, "chain": args.chain, "command": "python " + " ".join(sys.argv)}
    rows = Rows(args.max_new_tokens)
    hf_out = hf_baselines(target, prompts, args, rows)
    if args.compare_decodes:
        return {"meta": meta, "decodes": compare_decodes(target, prompts, hf_out, args)}
    compile_flag = {"compiled": True, "eager": False}[args.decode]
    generators: dict[int, SpeculativeGenerator] = {}
    meta["fixpoint_rounds"] = []
    for nodes in (None, args.tree):
        gen, rounds = oracle_run(target, prompts, hf_out, args, rows, nodes, compile_flag)
        generators[gen.budget] = gen
        meta["fixpoint_rounds"] += rounds
    sizes = sorted(set(args.sizes) | set(generators))
    for n in sizes:  # t(N), compiled
        if n not in generators:
            generators[n] = SpeculativeGenerator(target, OracleDrafter(hf_out[0][0], args.prompt_tokens, n - 1, vocab),
                                                 compile=compile_flag)
    costs = verify_costs(sizes, prompts[0], generators, args.max_new_tokens, args.cost_repeats)
    add_bounds(rows.rows, costs)
    result = {"meta": meta, "rows": rows.rows, "verify_cost_ms": {n: 1e3 * t for n, t in costs.items()}}
    if args.head_draft:
        result["eagle3_head_draft_ms"] = {k: 1e3 * v for k, v in head_draft_cost(target, args, device, dtype).items()}
    return result
