"""One benchmark run (``draftsmith bench``): every decoding method on one target, the same prompts, against the
bound; the results ``infer.bench.report.write_report`` writes."""
from __future__ import annotations

import sys
import time

import torch

from draftsmith.data.base.device import default_device
from draftsmith.data.targets import load_target, load_target_config, load_target_tokenizer, resolve_target
from draftsmith.infer.bench.batch import time_batches
from draftsmith.infer.bench.cost import step_costs
from draftsmith.infer.bench.methods import build_methods, time_methods
from draftsmith.infer.bench.profile import profile_heads
from draftsmith.infer.bench.prompts import load_prompts
from draftsmith.infer.bench.report import summarise
from draftsmith.infer.bench.sampled import time_sampled
from draftsmith.infer.bench.timing import ForwardCounter, hardware
from draftsmith.target.recurrent import check_supported
from draftsmith.target.threads import choose_threads


def run_benchmark(args, command: str) -> dict:
    """Time every method ``args`` (``scripts/benchmark.py``'s options) asks for; returns the results: meta, rows,
    the verify costs t(N), every run, and the profile and batch tables when asked for."""
    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes else None
    device = default_device(args.device)
    if device.type == "cpu":  # the one thread policy (target.threads): --threads, OMP_NUM_THREADS or a probe
        print(choose_threads(args.threads), file=sys.stderr, flush=True)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    target_path = resolve_target(args.target)  # results keep the name given (demo:smollm2), not the cache path
    check_supported(load_target_config(target_path))  # a stateful model it cannot decode: one line, before loading
    target = load_target(target_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    tokenizer = load_target_tokenizer(target_path)
    prompts = load_prompts(args, tokenizer)
    sizes = sorted(set(args.tree_sizes) | {1})
    counter = ForwardCounter(target)
    skipped: dict[str, str] = {}  # methods a hybrid target cannot run, with why (reported, not timed)
    methods = build_methods(args, target, tokenizer, skipped)
    generators = [m.generator for m in methods if m.generator is not None]
    counter.enabled(False)  # t(N) runs on the generators' own step (a hook could be traced into a graph)
    costs = step_costs(target, prompts[0], sizes, args, generators)
    timed = time_methods(methods, prompts, args, target, counter, deadline)
    prompts = prompts[:timed]
    rows = summarise(methods, costs)
    unstable = [r["method"] for r in rows if r["timings_unstable"]]
    if unstable:  # the table says "unstable" for these rows instead of an impossible percentage
        print(f"benchmark: timings unstable for {', '.join(unstable)} (efficiency over 100%): the machine's load "
              "changed between measurements; rerun on an idle one", file=sys.stderr, flush=True)
    meta = {
        "target": args.target, "heads": args.heads, "assistant": args.assistant,
        "assistant_head": args.assistant_head, "hardware": hardware(device),
        "dtype": str(dtype).removeprefix("torch."), "num_prompts": len(prompts), "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens, "torch": torch.__version__, "command": command,
        "skipped": skipped,
    }
    result = {"meta": meta, "rows": rows, "verification_cost_s": costs,
              "runs": {m.name: m.runs for m in methods}}
    temperatures = getattr(args, "temperatures", [0.0])
    if any(t > 0 for t in temperatures):  # sampled decoding: HF's sampled generate against every generator method
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        result["sampled"] = time_sampled(methods, prompts, args, target, pad)
    if args.profile:
        result["profile"] = profile_heads(methods, prompts, args, device)
    if args.batch_sizes:
        result["batch"] = time_batches(methods, prompts, args.batch_sizes, args, target, tokenizer)
    return result
