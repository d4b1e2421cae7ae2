"""The phases of ``lab/gpu_lease.py`` and the loop that runs them within one budget.

Every phase takes the ``Lease`` (device, sizes, deadlines, results so far) and returns a dict of what it
measured; the loop writes ``results.json`` and ``summary.md`` after each one. The speed phases reuse
``infer.bench`` (what ``scripts/bench_scale.py`` and ``scripts/benchmark.py`` run): random targets of real
shapes, the oracle drafter, HF's static-cache baselines, the verify cost t(N), batch timing.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

from draftsmith.data.base.device import default_device, sync
from draftsmith.data.base.paths import claim_report_dir
from draftsmith.data.entry_point import one_line
from draftsmith.lab.lease_heads import heads, summary

REPO = Path(__file__).resolve().parents[1]
SMOKE_SCALE = 1e-3  # --smoke: the H100 estimates scaled to a CPU's seconds-scale run of tiny shapes
SMOKE_PHASE_S = 900  # --smoke: a phase's own deadline at least this (its estimate is scaled to milliseconds; two
# training launches on a busy 2-core box took ~2 minutes)
SMOKE_SHAPES = {"llama3.1-8b": "tiny", "qwen3-8b": "tiny-qwen3", "qwen3.5-9b": "tiny-qwen3.5"}
LOG_TAIL = 200_000  # bytes of each training log copied into the output folder


class Lease:
    """One run: device, sizes, the clock and deadlines, and the results rewritten after each phase."""

    def __init__(self, args, plan: dict[str, float], started: float) -> None:
        self.device = default_device(args.device)
        self.cuda = self.device.type == "cuda"
        self.smoke = args.smoke
        self.out = claim_report_dir(args.out)
        self.work = Path(tempfile.mkdtemp(prefix="draftsmith-lease-"))  # heads, caches: not in the output folder
        self.plan = {k: v * (SMOKE_SCALE if args.smoke else 1) for k, v in plan.items()}
        self.start, self.budget, self.deadline = started, args.budget_s, 0.0
        self.compile = self.cuda  # the generator's default: compiled with CUDA graphs on CUDA, eager on CPU
        # t(N): traced and CUDA-graphed without inductor's codegen (seconds, not ~50 s, per N); --sweep-backend
        self.sweep_compile = {"eager": False, "inductor": True}.get(args.sweep_backend, args.sweep_backend) \
            if self.cuda else False
        self.kept: dict = {}  # what a later phase reuses (the 8B target and its HF output)
        self.results = {"command": " ".join(["python", "lab/gpu_lease.py", *sys.argv[1:]]),
                        "budget_s": self.budget, "smoke": self.smoke, "plan_s": self.plan, "phases": {}, "skipped": {}}

    def left(self) -> float:
        """Seconds left of the whole budget."""
        return self.budget - (time.monotonic() - self.start)

    def over(self) -> bool:
        """Whether the running phase has passed its own deadline (its estimate with half again as slack, at most the
        budget's end)."""
        return time.monotonic() > self.deadline

    def shape(self, name: str) -> str:
        return SMOKE_SHAPES[name] if self.smoke else name

    def sizes(self, full: tuple, smoke: tuple) -> tuple:
        return smoke if self.smoke else full

    def write(self) -> None:
        """results.json and summary.md, each replaced whole (a cut run leaves the last complete pair)."""
        for name, text in (("results.json", json.dumps(self.results, indent=1, default=str)),
                           ("summary.md", summary(self.results))):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


def run_lease(args, plan: dict[str, float], started: float) -> int:
    """Every phase of ``args.phases`` that fits the time left of the budget counted from ``started`` (a
    ``time.monotonic()``); 0 when none failed."""
    lease = Lease(args, plan, started)
    lease.write()
    for name in args.phases:
        estimate = lease.plan[name]
        if estimate > lease.left():
            lease.results["skipped"][name] = f"needs ~{estimate:.1f} s by the rates, {max(lease.left(), 0):.1f} s left"
            print(f"gpu_lease: {name} skipped: {lease.results['skipped'][name]}", flush=True)
            lease.write()
            continue
        print(f"gpu_lease: {name} (~{estimate:.1f} s; {lease.left():.0f} s left) ...", flush=True)
        began = time.monotonic()
        lease.deadline = min(began + max(1.5 * estimate, SMOKE_PHASE_S if lease.smoke else 0), began + lease.left())
        try:
            data = PHASES[name](lease)
        except Exception as err:  # a phase's failure is a result: the next phase still runs
            data = {"error": f"{type(err).__name__}: {one_line(err)}", "traceback": traceback.format_exc()[-3000:]}
        data["seconds"] = round(time.monotonic() - began, 1)
        data["estimate_s"] = round(estimate, 1)
        lease.results["phases"][name] = data
        lease.write()
        print(f"gpu_lease: {name} done in {data['seconds']} s", flush=True)
        free(lease, keep=name != "batch" and "batch" in args.phases[args.phases.index(name) + 1:])
    lease.results["wall_s"] = round(time.monotonic() - lease.start, 1)
    lease.write()
    shutil.rmtree(lease.work, ignore_errors=True)  # the trained heads and logs (their tails are in the output)
    print(summary(lease.results), flush=True)
    return 1 if any("error" in p for p in lease.results["phases"].values()) else 0


def free(lease: Lease, keep: bool) -> None:
    """Release device memory between phases (the 8B target stays while the batch phase is still to come)."""
    if not keep:
        lease.kept.clear()
    gc.collect()  # generators hold their CUDA-graph pools until collected
    if lease.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- phase 1: the device

def probe(lease: Lease) -> dict:
    """The device and versions, and the device-to-device copy rate (bytes read + written per second)."""
    import transformers

    numel = (2 ** 28 if lease.cuda else 2 ** 22) // 2  # 256 MiB of bf16 on CUDA (4 MiB on CPU)
    src = torch.randn(numel, device=lease.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        sync(lease.device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(lease.device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    rate = 2 * src.numel() * src.element_size() / sorted(times)[len(times) // 2]
    lease.kept["copy_bytes_per_s"] = rate
    name = torch.cuda.get_device_name(lease.device) if lease.cuda else "cpu"
    return {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
            "copy_tb_per_s": round(rate / 1e12, 4), "fla": importlib.util.find_spec("fla") is not None,
            "datasets": importlib.util.find_spec("datasets") is not None}


def copy_rate(lease: Lease) -> float:
    """The probe's copy rate, measured now if the probe did not run."""
    if "copy_bytes_per_s" not in lease.kept:
        probe(lease)
    return lease.kept["copy_bytes_per_s"]


# ---------------------------------------------------------------- phases 2-3: real shapes, random weights

def scale_args(lease: Lease, shape: str, chain: int = 4, tree: int = 5):
    """``scripts/bench_scale.py``'s options for one prompt at ``shape`` (its parser, its defaults)."""
    from draftsmith.scripts.bench_scale import parse_args

    tokens = "6" if lease.smoke else "128"
    return parse_args(["--shape", lease.shape(shape), "--num-prompts", "1", "--prompt-tokens", tokens,
                       "--max-new-tokens", tokens, "--repeats", "1" if lease.smoke else "2", "--chain", str(chain),
                       "--tree", str(tree), "--cost-repeats", "1" if lease.smoke else "30", "--skip-hf-eager",
                       "--fixpoint-rounds", "2" if lease.smoke else "4",
                       "--dtype", "bfloat16" if lease.cuda else "float32"])


def hbm_bound_ms(target, lease: Lease, context: int) -> dict:
    """The least time a one-token forward can take: every weight it reads (all but the input embedding, whose one
    row is gathered, unless tied to the lm_head) and the KV cache of ``context`` tokens, at the copy rate."""
    weights = sum(p.numel() * p.element_size() for p in target.parameters())
    embed = target.get_input_embeddings().weight
    if embed is not target.get_output_embeddings().weight:
        weights -= embed.numel() * embed.element_size()
    cfg = target.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention_layers = sum(t == "full_attention" for t in getattr(cfg, "layer_types", None) or
                           ["full_attention"] * cfg.num_hidden_layers)
    kv = 2 * attention_layers * cfg.num_key_value_heads * head_dim * context * embed.element_size()
    return {"bytes_read": weights + kv, "hbm_bound_ms": 1e3 * (weights + kv) / copy_rate(lease)}


def sweep(lease: Lease, target, prompt: torch.Tensor, sizes: tuple, args, compile) -> dict[int, float]:
    """t(N) seconds of the verify step for each N (``infer.bench.cost.verify_costs``: sizes interleaved)."""
    from draftsmith.infer import SpeculativeGenerator
    from draftsmith.infer.bench.cost import verify_costs
    from draftsmith.infer.bench.oracle import OracleDrafter

    vocab = target.config.get_text_config().vocab_size
    gens = {n: SpeculativeGenerator(target, OracleDrafter(prompt[0], prompt.shape[1], n - 1, vocab), compile=compile)
            for n in sizes}
    return verify_costs(list(sizes), prompt, gens, args.max_new_tokens, args.cost_repeats)


def cost_rows(costs: dict[int, float], bound: dict) -> dict:
    """t(N) in ms, t(N)/t(1), and t(1) against the HBM bound."""
    t1 = costs[min(costs)]
    return {"t_ms": {n: round(1e3 * t, 4) for n, t in costs.items()},
            "t_over_t1": {n: round(t / t1, 4) for n, t in costs.items()},
            "t1_over_hbm_bound": round(1e3 * t1 / bound["hbm_bound_ms"], 3), **bound}


def build(lease: Lease, shape: str, args):
    """A random target of ``shape`` on the lease's device, and one random prompt."""
    from draftsmith.infer.bench.shapes import build_target

    start = time.perf_counter()
    target = build_target(args.shape, lease.device, getattr(torch, args.dtype), args.seed)
    vocab = target.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    info = {"shape": args.shape, "params_b": round(sum(p.numel() for p in target.parameters()) / 1e9, 4),
            "build_s": round(time.perf_counter() - start, 1)}
    return target, prompt.to(lease.device), info


def shape_costs(lease: Lease, shape: str, sizes: tuple) -> dict:
    """Phase 3 (and the first half of phase 2): t(1) against the HBM bound and t(N)/t(1) at ``shape``."""
    from torch._dynamo.utils import counters

    args = scale_args(lease, shape)
    target, prompt, info = build(lease, shape, args)
    skips = counters["inductor"]["cudagraph_skips"]
    costs = sweep(lease, target, prompt, sizes, args, lease.sweep_compile)
    # a graph that could not be captured runs eagerly (launch-bound t(N)); torch counts each such skip
    info.update(cost_rows(costs, hbm_bound_ms(target, lease, args.prompt_tokens + args.max_new_tokens)),
                sweep_backend=str(lease.sweep_compile or "eager"),
                sweep_cudagraph_skips=counters["inductor"]["cudagraph_skips"] - skips)
    lease.kept[shape] = (target, prompt, args)
    return info


def shape_llama(lease: Lease) -> dict:
    """Phase 2: the 8B shape's costs, then HF static against our generator with the oracle at τ 5 and τ 3, the
    bound τ·t(1)/t(N) and efficiency, and random EAGLE-3 / DFlash heads' draft cost (P1, P2, P7)."""
    from draftsmith.infer.bench.cost import verify_costs
    from draftsmith.infer.bench.scale import Rows, add_bounds, hf_baselines, oracle_run

    info = shape_costs(lease, "llama3.1-8b", lease.sizes((1, 8, 64), (1, 2, 4)))
    target, prompt, args = lease.kept["llama3.1-8b"]
    rows = Rows(args.max_new_tokens)
    hf_out = hf_baselines(target, [prompt], args, rows)
    lease.kept["hf_out"] = hf_out
    # τ 5: a chain of 4 true drafts; τ 3: 2 true drafts and 2 decoys: the same N = 5, one compiled verify step
    gen, rounds = oracle_run(target, [prompt], hf_out, args, rows, None, lease.compile, name="ours:oracle-tau5")
    oracle_run(target, [prompt], hf_out, scale_args(lease, "llama3.1-8b", chain=2), rows, 5, lease.compile,
               gen=gen, name="ours:oracle-tau3")
    costs = {int(n): ms / 1e3 for n, ms in info["t_ms"].items()}
    add_bounds(rows.rows, costs)
    info["rows"] = rows.rows
    info["t5_ms_generator"] = 1e3 * verify_costs([5], prompt, {5: gen}, args.max_new_tokens, args.cost_repeats)[5]
    info["fixpoint_rounds"] = rounds
    info["head_draft_ms"] = head_costs(lease, target, args)
    return info


def head_costs(lease: Lease, target, args) -> dict:
    """ms per draft of random EAGLE-3 (the GPU's dynamic tree) and DFlash (its 15-draft block) heads at the
    target's shape, eager and as the generator compiles them (skipped past the phase's deadline)."""
    from draftsmith.infer import Chain, DynamicTree
    from draftsmith.infer.bench.scale import head_draft_cost

    tree = DynamicTree(depth=8, top_k=10, total_tokens=60)
    compiled = "-compiled" if lease.compile else "-default"
    result = {}
    for kind, name, shape in (("eagle3", "dyn8-10-60", tree), ("dflash", "block15", Chain(15))):
        if lease.over():
            result[kind] = "skipped: past the phase's deadline"
            continue
        shapes = ((name, shape, False), (name + compiled, shape, lease.compile))
        result[kind] = {k: round(1e3 * v, 4) for k, v in head_draft_cost(target, args, lease.device,
                                                                          target.dtype, kind, shapes).items()}
    return result


def shape_qwen3(lease: Lease) -> dict:
    """Phase 3: t(1) against the HBM bound and t(N)/t(1) at Qwen3-8B's shape (P7)."""
    info = shape_costs(lease, "qwen3-8b", lease.sizes((1, 8, 64), (1, 2, 4)))
    lease.kept.pop("qwen3-8b", None)
    return info


# ---------------------------------------------------------------- phase 4: batches

def batch(lease: Lease) -> dict:
    """Batch speculation (the τ-5 oracle, eager: a batch decodes eager) at bs 4 and 16 against HF batched
    static-cache ``generate`` on the 8B shape (``infer.bench.batch.time_batches``); bs 1 is phase 2's (P8)."""
    from draftsmith.infer import SpeculativeGenerator
    from draftsmith.infer.bench.batch import time_batches
    from draftsmith.infer.bench.oracle import OracleDrafter
    from draftsmith.infer.bench.scale import Rows, hf_baselines

    if "llama3.1-8b" not in lease.kept:
        args = scale_args(lease, "llama3.1-8b")
        lease.kept["llama3.1-8b"] = (*build(lease, "llama3.1-8b", args)[:2], args)
    target, prompt, args = lease.kept["llama3.1-8b"]
    if "hf_out" not in lease.kept:
        lease.kept["hf_out"] = hf_baselines(target, [prompt], args, Rows(args.max_new_tokens))
    vocab = target.config.get_text_config().vocab_size
    gen = SpeculativeGenerator(target, OracleDrafter(lease.kept["hf_out"][0][0], prompt.shape[1], 4, vocab),
                               compile=False)
    method = SimpleNamespace(name="ours:oracle-tau5-eager", generator=gen)
    options = SimpleNamespace(ignore_eos=True, max_new_tokens=args.max_new_tokens, warmup=1, repeats=1)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    rows = time_batches([method], [prompt[0].tolist()], list(lease.sizes((4, 16), (2, 3))), options, target, tokenizer)
    return {"shape": args.shape, "rows": rows, "tau_last": gen.last_stats.tau}


# ---------------------------------------------------------------- phase 6: a hybrid

def hybrid(lease: Lease) -> dict:
    """A Gated DeltaNet hybrid at Qwen3.5-9B's shape: t(N)/t(1) of its (eager) verify, and our generator with an
    oracle chain of 4 whose every 4th token is wrong (a partial accept, so a rollback, most steps), profiled: the
    rollback's share of the step time. fla's kernels when fla-core travelled, else transformers' torch reference."""
    from draftsmith.infer import SpeculativeGenerator
    from draftsmith.infer.bench.oracle import OracleDrafter

    args = scale_args(lease, "qwen3.5-9b")
    target, prompt, info = build(lease, "qwen3.5-9b", args)
    info["kernels"] = "fla" if importlib.util.find_spec("fla") else "torch reference (no fla)"
    new = 12 if lease.smoke else 64
    with torch.inference_mode():
        ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0)
    vocab = target.config.get_text_config().vocab_size
    seq = ref[0].clone()
    wrong = torch.arange(prompt.shape[1] + 3, seq.numel(), 4, device=seq.device)
    seq[wrong] = (seq[wrong] + 1) % vocab
    gen = SpeculativeGenerator(target, OracleDrafter(seq, prompt.shape[1], 4, vocab), compile=False, profile=True)
    with torch.inference_mode():
        gen.generate(prompt, max_new_tokens=new, eos_token_id=[])  # warm-up
        out = gen.generate(prompt, max_new_tokens=new, eos_token_id=[])
    stats = gen.last_stats
    info.update(tau=round(stats.tau, 3), tokens_per_s=round(stats.new_tokens / stats.wall_time, 2),
                identical_to_hf=bool(torch.equal(out, ref)), replays=stats.replays,
                phase_ms={k: round(1e3 * v, 3) for k, v in stats.phase_times.items()},
                rollback_share=round(stats.phase_times.get("rollback", 0.0) / stats.wall_time, 4),
                verify_share=round(stats.phase_times.get("verify", 0.0) / stats.wall_time, 4),
                # "merged" (a GPU's default): the accepted tokens of a partial accept are verified again in front of the
                # next draft; "recorded" (the CPU's) verifies nothing twice
                reverify_share=round(stats.pending_tokens / max(stats.verified_tokens, 1)
                                     * stats.phase_times.get("verify", 0.0) / stats.wall_time, 4),
                rollback=gen.rollback.rule, pending_tokens=stats.pending_tokens)
    if not lease.over():
        costs = sweep(lease, target, prompt, lease.sizes((1, 2, 4, 8, 16), (1, 2, 4)), args, False)
        info.update(cost_rows(costs, hbm_bound_ms(target, lease, args.prompt_tokens + new)), sweep_backend="eager")
    return info


PHASES: dict = {"probe": probe, "shape-llama3.1-8b": shape_llama, "shape-qwen3-8b": shape_qwen3, "batch": batch,
                "heads": heads, "hybrid": hybrid}
