"""Decoding speed at real model shapes without downloading a model: random weights, an oracle drafter.

    python scripts/bench_scale.py --shape llama3.1-8b --out docs/bench-gpu-8b
    python scripts/bench_scale.py --shape smollm2-135m --out docs/bench-gpu-135m

Builds a randomly initialised target of the shape (bf16, sdpa, on CUDA when present) and measures,
on the same prompts in one run:
- HF ``generate`` eager (DynamicCache) and with ``cache_implementation="static"`` (compiled by HF),
- ``SpeculativeGenerator`` with an oracle drafter that drafts the target's own greedy continuation,
  as a chain of ``--chain`` drafts and inside a ``--tree``-node tree (the true path of depth
  ``--chain`` plus decoys), on the static cache with the compiled verify step (or ``--decode``),
- the compiled verify cost t(N) for N in ``--sizes`` plus the chain's and the tree's N,
- the bound τ·t(1)/t(N) (drafting free, no overhead), efficiency = speedup over t(1)-per-token
  decoding / bound, peak memory,
- with ``--head-draft``: what a real EAGLE-3 head of the target's dimensions (``--draft-vocab``
  tokens) costs per draft, as a chain and as an EAGLE-2 dynamic tree (depth 8, top-k 10, 60 nodes).

Random weights make a near-flat next-token distribution, where a multi-token verify in bf16 can
round to a different argmax than one-token decoding. So the oracle aims at the generator's own
greedy path: start from HF's static-cache output, run the generator with the oracle, and repeat
with its output until the output stops changing (``--fixpoint-rounds``). Compilation is reported
separately (compile_s) and excluded by warm-up runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from data.base.device import default_device, sync  # noqa: E402
from heads import build_head  # noqa: E402
from infer import Chain, DynamicTree, SpeculativeGenerator  # noqa: E402
from infer.drafters import Draft, EagleDrafter, Sampling  # noqa: E402
from infer.generator import GenerationStats  # noqa: E402
from infer.tree import chain_parents, tree_from_parents  # noqa: E402

SHAPES = {
    # Llama-3.1-8B's published config.json (context cut to 8k: the buffer is what matters)
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                        max_position_embeddings=8192, rms_norm_eps=1e-5),
    # SmolLM2-135M-Instruct
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    # the demo target's dimensions (scripts/make_demo_target.py --size tiny)
    "demo-tiny": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=3,
                      num_key_value_heads=1, vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=2048),
    # for trying the script on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=2048),
}


class OracleDrafter:
    """Drafts ``sequence`` (the expected output, prompt included) from the current position: a
    chain of ``depth`` tokens, or with ``tree_nodes`` that chain plus decoy children (tokens the
    sequence does not continue with) spread over the root and the chain nodes, ``tree_nodes`` in
    all. A wrong guess (the generator left the sequence) is simply rejected."""

    aux_layer_ids = ()

    def __init__(self, sequence: torch.Tensor, prompt_len: int, depth: int, vocab_size: int,
                 tree_nodes: int | None = None) -> None:
        self.seq, self.depth, self.vocab_size = sequence, depth, vocab_size
        self.prompt_len = prompt_len
        self.max_nodes = tree_nodes or depth + 1
        self._trees: dict[int, tuple] = {}

    def new_state(self) -> dict:
        return {"pos": self.prompt_len}  # index of the root (the first new token) in seq

    def observe(self, state: dict, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        if features.shape[1] != next_tokens.shape[1] or features.shape[1] == 0:
            raise AssertionError("the generator must pass one feature per accepted token")
        state["pos"] += next_tokens.shape[1] if state.get("started") else 0
        state["started"] = True

    def _layout(self, levels: int, device: torch.device):
        """Parents and, per node, (depth, is_path) of the tree for ``levels`` draft levels."""
        if levels not in self._trees:
            if self.max_nodes == self.depth + 1 or levels == 0:
                parents = chain_parents(levels)
                on_path = [True] * (levels + 1)
                depths = list(range(levels + 1))
            else:
                decoys = self.max_nodes - 1 - levels
                per_parent = [decoys // (levels + 1) + (i < decoys % (levels + 1)) for i in range(levels + 1)]
                parents, on_path, depths, path = [-1], [True], [0], [0]
                for d in range(1, levels + 2):  # level d: the path node (d <= levels) and decoys of path[d-1]
                    if d <= levels:
                        parents.append(path[d - 1]); on_path.append(True); depths.append(d)
                        path.append(len(parents) - 1)
                    for _ in range(per_parent[d - 1]):
                        parents.append(path[d - 1]); on_path.append(False); depths.append(d)
            buffers = tree_from_parents(parents, device)
            self._trees[levels] = (buffers, torch.tensor(on_path, device=device), torch.tensor(depths, device=device))
        return self._trees[levels]

    def propose(self, state: dict, root: torch.Tensor, sampling: Sampling, max_depth: int) -> Draft:
        pos = state["pos"]
        levels = max(0, min(self.depth, max_depth, self.seq.numel() - pos - 1))
        buffers, on_path, depths = self._layout(levels, root.device)
        truth = self.seq[pos + depths.clamp(max=self.seq.numel() - pos - 1)]  # (N,) true token at each depth
        # 1 + i < vocab: a decoy never equals the true token at its depth
        decoy = (truth + 1 + torch.arange(truth.numel(), device=root.device)) % self.vocab_size
        tokens = torch.where(on_path, truth, decoy)
        tokens[0] = root
        return Draft(tokens, buffers)


def timed(fn, warmup: int, repeats: int) -> tuple[float, object]:
    """(median seconds, last result) over ``repeats`` calls after ``warmup`` calls."""
    out, times = None, []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out


def build_target(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def verify_costs(sizes: list[int], prompt: torch.Tensor, generators: dict[int, SpeculativeGenerator],
                 max_new_tokens: int, repeats: int) -> dict[int, float]:
    """Median seconds of one compiled static verify over N tokens after the prompt, per N; sizes
    interleaved round-robin. Uses each N's generator (its compiled step and its cache)."""
    states = {}
    for n in sizes:
        gen = generators[n]
        with torch.inference_mode():
            gen._prefill(prompt, max_new_tokens)  # fills gen's static cache with the prompt
        cache = gen._static_cache
        draft = Draft(prompt[0, -1:].expand(n).clone(), tree_from_parents(chain_parents(n - 1), prompt.device))
        states[n] = (gen, cache, draft)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        for rep in range(repeats + 3):  # 3 warm-up rounds (compile, CUDA-graph recording)
            for n in sizes:
                gen, cache, draft = states[n]
                sync()
                start = time.perf_counter()
                gen._static_verify(cache, prompt.shape[1], draft, GenerationStats())
                sync()
                if rep >= 3:
                    times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def head_draft_cost(target, args, device, dtype) -> dict:
    """Per-draft cost of a random EAGLE-3 head of the target's dimensions."""
    cfg = target.config
    torch.manual_seed(0)
    head = build_head("eagle3", target, draft_vocab_size=min(args.draft_vocab, cfg.vocab_size)).to(device, dtype).eval()
    result = {}
    for name, tree in (("chain", Chain(args.chain)), ("dyn8-10-60", DynamicTree(depth=8, top_k=10, total_tokens=60))):
        drafter = EagleDrafter(head, target, tree)
        state = drafter.new_state()
        drafter.reserve(state, args.prompt_tokens + args.max_new_tokens)
        features = torch.randn(1, args.prompt_tokens, 3 * cfg.hidden_size, device=device, dtype=dtype)
        tokens = torch.randint(3, cfg.vocab_size, (1, args.prompt_tokens), device=device)
        with torch.inference_mode():
            drafter.observe(state, features, tokens)
            root = tokens[0, -1]
            seconds, _ = timed(lambda: drafter.propose(state, root, Sampling(), max_depth=64), 3, args.cost_repeats)
        result[name] = seconds
    return result


DECODES = {"dynamic": ("dynamic", False), "static-eager": ("static", False), "static-compiled": ("static", True)}


def compare_decodes(target, prompts, hf_out, args) -> dict:
    """ms/token of the oracle chain under each decode state, timed round-robin (one run of each
    mode in turn, ``--repeats`` rounds after a warm-up round), so a busy host slows every mode alike.
    This is how the per-device defaults (``default_decode_settings``) were chosen."""
    vocab = target.config.vocab_size
    times: dict[str, list[float]] = {mode: [] for mode in DECODES}
    taus: dict[str, list[float]] = {mode: [] for mode in DECODES}
    for p, ref in zip(prompts, hf_out):
        oracle = OracleDrafter(ref[0], p.shape[1], args.chain, vocab)
        gens = {mode: SpeculativeGenerator(target, oracle, cache_implementation=cache, compile=comp)
                for mode, (cache, comp) in DECODES.items()}
        for rnd in range(args.repeats + 1):
            for mode, gen in gens.items():
                with torch.inference_mode():
                    seconds, _ = timed(lambda: gen.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=[]), 0, 1)
                if rnd:
                    times[mode].append(seconds / args.max_new_tokens)
                    taus[mode].append(gen.last_stats.tau)
    return {mode: {"ms_per_token": 1e3 * statistics.median(t), "tau": statistics.fmean(taus[mode])}
            for mode, t in times.items()}


def run(args) -> dict:
    device = default_device(args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    target = build_target(args.shape, device, dtype, args.seed)
    print(f"built {args.shape} ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B params) in "
          f"{time.perf_counter() - t0:.1f} s on {device}", flush=True)
    gen_ = torch.Generator().manual_seed(args.seed)
    vocab = target.config.vocab_size
    prompts = [torch.randint(3, vocab, (1, args.prompt_tokens), generator=gen_).to(device) for _ in range(args.num_prompts)]
    hf_kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    rows, meta = {}, {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "dtype": args.dtype, "torch": torch.__version__, "prompt_tokens": args.prompt_tokens,
                      "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts, "chain": args.chain,
                      "command": "python " + " ".join(sys.argv)}
    import transformers

    meta["transformers"] = transformers.__version__

    def record(name, seconds_list, taus=None, compile_s=None, peak=None, identical=None):
        per_tok = statistics.median(s / args.max_new_tokens for s in seconds_list)
        rows[name] = {"ms_per_token": 1e3 * per_tok, "tokens_per_s": 1 / per_tok,
                      "tau": statistics.fmean(taus) if taus else 1.0, "compile_s": compile_s,
                      "peak_mem_gib": peak, "identical_to_hf_static": identical}
        print(f"{name:>24}: {1e3 * per_tok:7.2f} ms/token  {1 / per_tok:7.1f} tok/s"
              + (f"  tau {rows[name]['tau']:.2f}" if taus else ""), flush=True)

    def peak_reset():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak():
        return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None

    # HF baselines
    with torch.inference_mode():
        if not args.skip_hf_eager:
            peak_reset()
            secs = [timed(lambda p=p: target.generate(p, **hf_kw), 1, args.repeats)[0] for p in prompts]
            record("hf-eager", secs, peak=peak())
        peak_reset()
        start = time.perf_counter()
        target.generate(prompts[0], cache_implementation="static", **hf_kw)  # compiles
        hf_compile = time.perf_counter() - start
        hf_out, secs = [], []
        for p in prompts:
            s, out = timed(lambda p=p: target.generate(p, cache_implementation="static", **hf_kw), 1, args.repeats)
            secs.append(s)
            hf_out.append(out)
        record("hf-static", secs, compile_s=hf_compile, peak=peak())

    if args.compare_decodes:
        return {"meta": meta, "decodes": compare_decodes(target, prompts, hf_out, args)}

    # Oracle runs on our generator
    compile_flag = {"compiled": True, "eager": False}[args.decode]
    generators: dict[int, SpeculativeGenerator] = {}
    fixpoint_rounds = []
    for label, nodes in (("chain", None), ("tree", args.tree)):
        name = f"ours:oracle-{label}{args.chain if nodes is None else nodes}"
        seconds, taus, identical = [], [], []
        gen = None
        peak_reset()
        compile_s = 0.0
        for p, ref in zip(prompts, hf_out):
            seq = ref[0]
            for rnd in range(args.fixpoint_rounds):
                oracle = OracleDrafter(seq, p.shape[1], args.chain, vocab, nodes)
                if gen is None:
                    gen = SpeculativeGenerator(target, oracle, cache_implementation="static", compile=compile_flag)
                gen.drafter = oracle
                with torch.inference_mode():
                    out = gen.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=[])
                compile_s += gen.last_stats.compile_time
                if torch.equal(out[0], seq):
                    break
                seq = out[0]
            fixpoint_rounds.append(rnd + 1)
            with torch.inference_mode():
                s, out = timed(lambda: gen.generate(p, max_new_tokens=args.max_new_tokens, eos_token_id=[]),
                               1, args.repeats)
            seconds.append(s)
            taus.append(gen.last_stats.tau)
            identical.append(bool(torch.equal(out, ref)))
        record(name, seconds, taus, compile_s=compile_s, peak=peak(), identical=sum(identical) / len(identical))
        rows[name]["budget"] = gen._budget
        generators[gen._budget] = gen
    meta["fixpoint_rounds"] = fixpoint_rounds

    # t(N), compiled
    sizes = sorted(set(args.sizes) | set(generators))
    for n in sizes:
        if n not in generators:
            generators[n] = SpeculativeGenerator(target, OracleDrafter(hf_out[0][0], args.prompt_tokens, n - 1, vocab),
                                                 cache_implementation="static", compile=compile_flag)
    costs = verify_costs(sizes, prompts[0], generators, args.max_new_tokens, args.cost_repeats)
    t1 = costs[1]
    for name, row in rows.items():
        n = row.get("budget", 1)
        speedup = t1 / (row["ms_per_token"] / 1e3)  # over one compiled forward per token
        bound = row["tau"] * t1 / costs.get(n, t1)
        row.update(speedup_vs_t1=speedup, bound=bound, efficiency=speedup / bound,
                   speedup_vs_hf_static=rows["hf-static"]["ms_per_token"] / row["ms_per_token"])
    result = {"meta": meta, "rows": rows, "verify_cost_ms": {n: 1e3 * t for n, t in costs.items()}}
    if args.head_draft:
        result["eagle3_head_draft_ms"] = {k: 1e3 * v for k, v in head_draft_cost(target, args, device, dtype).items()}
    return result


def markdown(result: dict) -> str:
    m = result["meta"]
    if "decodes" in result:
        lines = [f"`{m['command']}` — {m['shape']}, {m['device']}, {m['dtype']}, torch {m['torch']}, "
                 f"{torch.get_num_threads()} threads; oracle chain of {m.get('chain', '?')}, round-robin.", "",
                 "| decode state | ms/token | τ |", "|---|---:|---:|"]
        lines += [f"| {mode} | {r['ms_per_token']:.2f} | {r['tau']:.2f} |" for mode, r in result["decodes"].items()]
        return "\n".join(lines) + "\n"
    lines = [f"`{m['command']}` — {m['shape']} shape (random weights), {m['device']}, {m['dtype']}, torch {m['torch']}, "
             f"transformers {m['transformers']}; {m['num_prompts']} prompts of {m['prompt_tokens']} tokens, "
             f"{m['max_new_tokens']} new tokens; oracle fixed point reached in {m['fixpoint_rounds']} rounds.", "",
             "| method | ms/token | tokens/s | τ | vs hf-static | vs t(1)/token | bound τ·t(1)/t(N) | efficiency | compile s | peak GiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["rows"].items():
        comp = f"{r['compile_s']:.1f}" if r["compile_s"] else "–"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] else "–"
        lines.append(f"| {name} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                     f"{r['speedup_vs_hf_static']:.2f}× | {r['speedup_vs_t1']:.2f}× | {r['bound']:.2f}× | "
                     f"{r['efficiency']:.0%} | {comp} | {mem} |")
    costs = result["verify_cost_ms"]
    t1 = costs[min(costs, key=int)]
    lines += ["", "| N | " + " | ".join(str(n) for n in costs) + " |", "|---|" + "---:|" * len(costs),
              "| t(N) ms | " + " | ".join(f"{c:.2f}" for c in costs.values()) + " |",
              "| t(N)/t(1) | " + " | ".join(f"{c / t1:.2f}" for c in costs.values()) + " |"]
    if "eagle3_head_draft_ms" in result:
        lines += ["", "EAGLE-3 head at these dimensions, ms per draft: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in result["eagle3_head_draft_ms"].items())]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3.1-8b")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--chain", type=int, default=5, help="oracle chain length (τ ≤ chain + 1)")
    p.add_argument("--tree", type=int, default=60, help="nodes of the oracle tree")
    p.add_argument("--sizes", default="1", help="extra N for the t(N) sweep (each compiles once)")
    p.add_argument("--cost-repeats", type=int, default=30)
    p.add_argument("--fixpoint-rounds", type=int, default=4)
    p.add_argument("--decode", choices=("compiled", "eager"), default="compiled")
    p.add_argument("--head-draft", action="store_true", help="also time a real EAGLE-3 head's drafts")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--skip-hf-eager", action="store_true")
    p.add_argument("--compare-decodes", action="store_true",
                   help="only time the oracle chain under dynamic / static eager / static compiled, round-robin")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for results.json and results.md")
    args = p.parse_args(argv)
    args.sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()} | {1})
    if args.chain < 1 or args.tree <= args.chain:
        p.error("--chain must be >= 1 and --tree larger than --chain")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args)
    text = markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        (out / "results.md").write_text(text)
    return result


if __name__ == "__main__":
    from data.cli import run as run_cli  # user mistakes: one line, exit code 2

    sys.exit(run_cli(main))
