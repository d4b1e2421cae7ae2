"""Phase 5 of ``lab/gpu_lease.py`` (trained demo heads, with the CUDA-only tests beside the training) and the
run's one-screen summary.

EAGLE-3 and DFlash heads train on ``demo:tiny`` side by side (two ``accelerate launch`` processes started together,
each stopped by the same ``train.max_minutes``: equal training time), on ``stdlib:train`` as it is (no
self-distillation: nothing to regenerate, nothing to download), with a constant learning rate after warm-up
(the schedule does not depend on how many steps the minutes hold). Both are then decoded with the generator's
defaults for the device (on CUDA: EAGLE-3's dynamic tree, DFlash's 15-draft block, verify and draft compiled
with CUDA graphs) on held-out code prompts, interleaved with vanilla decoding (the target's greedy ``generate``).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"eagle3": "configs/demo.yaml", "dflash": "configs/demo-dflash.yaml"}


def train_command(lease, kind: str, out: Path, minutes: float) -> list[str]:
    """``accelerate launch train/train_head.py`` for one demo head, stopped by ``minutes``."""
    from draftsmith.lab.gpu_report import accelerate_launch

    overrides = [f"output_dir={out}", f"train.max_minutes={minutes}", "train.decay=constant", "train.eval_every=0",
                 "train.save_every=0", "train.log_every=25", "data.self_distill.rows=0", "data.eval_rows=32"]
    if kind == "dflash":
        overrides.append("head.block_size=16")  # the published block: the GPU default drafts all 15
    if lease.smoke:
        overrides += ["train.max_steps=2", "train.micro_batch_size=1", 'train.mixed_precision="no"',
                      "data.eval_rows=2", "data.max_length=64", "train.eval_decode_tokens=8"]
    else:
        overrides += ["train.max_steps=1000000", "train.micro_batch_size=16", 'train.mixed_precision="bf16"']
    return [*accelerate_launch(not lease.cuda), str(REPO / "train" / "train_head.py"),
            "--config", str(REPO / CONFIGS[kind]), *overrides]


def gpu_tests_command() -> list[str]:
    """One pytest selection: the tests marked ``gpu`` (CUDA graphs, the compiled static step), in the files that
    mark any; on a machine without CUDA they skip."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())
    return [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "gpu", *files]


def start(lease, minutes: float) -> dict[str, tuple]:
    """The two trainings and the test selection, started together; name -> (process, log path)."""
    if importlib.util.find_spec("datasets") is None:
        raise RuntimeError("training needs the datasets package (train/ tokenizes into a datasets.Dataset): carry "
                           "its wheel with dill and multiprocess (docs/benchmarks.md, 'GPU: one command')")
    jobs = {}
    for name, cmd in [*((k, train_command(lease, k, lease.work / k, minutes)) for k in CONFIGS),
                      ("tests", gpu_tests_command())]:
        log = lease.work / f"{name}.log"
        with open(log, "w") as handle:
            jobs[name] = (subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO), log)
    return jobs


def finish(lease, jobs: dict[str, tuple]) -> dict:
    """Wait for each job until the phase's deadline; its exit code, and its log's tail copied to the output."""
    result = {}
    for name, (proc, log) in jobs.items():
        try:
            code = proc.wait(timeout=max(1.0, lease.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = f"killed at the phase's deadline ({proc.wait()})"
        text = log.read_bytes()[-200_000:].decode(errors="replace")
        (lease.out / ("tests.txt" if name == "tests" else f"train-{name}.log")).write_text(text)
        result[name] = {"exit": code}
        if name == "tests":
            result[name]["last_line"] = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
        else:
            steps = [json.loads(ln) for ln in (lease.work / name / "metrics.jsonl").read_text().splitlines()
                     if ln.strip()] if (lease.work / name / "metrics.jsonl").is_file() else []
            last = next((r for r in reversed(steps) if "loss" in r), {})
            evaluated = next((r for r in reversed(steps) if "tau" in r), {})
            result[name].update(step=max((r.get("step", 0) for r in steps), default=None), loss=last.get("loss"),
                                simulated_tau=evaluated.get("tau"))
    return result


def decode(lease, kinds: list[str]) -> dict:
    """Vanilla and each trained head at the device's defaults, prompt by prompt in turn after a warm-up each:
    τ, tokens/s, the speedup over vanilla, and whether every output equals vanilla's."""
    from draftsmith.data.corpus import continuation_prompts
    from draftsmith.infer import SpeculativeGenerator

    gens = {k: SpeculativeGenerator.from_pretrained("demo:tiny", str(lease.work / k), device=lease.device)
            for k in kinds}
    target = next(iter(gens.values())).target
    tokenizer = next(iter(gens.values())).tokenizer
    new = 16 if lease.smoke else 128
    prompts = [torch.tensor([ids], device=lease.device)
               for ids in continuation_prompts(tokenizer, 2 if lease.smoke else 4, 32 if lease.smoke else 128, new)]
    runs = {"vanilla": lambda ids: target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                   max_new_tokens=new, pad_token_id=0)}
    runs.update({k: (lambda g: lambda ids: g.generate(ids, max_new_tokens=new))(g) for k, g in gens.items()})
    totals = {name: {"s": 0.0, "tokens": 0, "taus": [], "identical": True} for name in runs}
    with torch.inference_mode():
        for name, run in runs.items():
            run(prompts[0])  # warm-up: compiles on CUDA
        for ids in prompts:
            reference = None
            for name, run in runs.items():
                begin = time.perf_counter()
                out = run(ids)
                if lease.cuda:
                    torch.cuda.synchronize()
                t = totals[name]
                t["s"] += time.perf_counter() - begin
                t["tokens"] += out.shape[1] - ids.shape[1]
                t["taus"].append(gens[name].last_stats.tau if name in gens else 1.0)
                reference = out if reference is None else reference
                t["identical"] &= bool(torch.equal(out, reference))
    base = totals["vanilla"]["tokens"] / totals["vanilla"]["s"]
    return {name: {"tau": round(sum(t["taus"]) / len(t["taus"]), 3), "tokens_per_s": round(t["tokens"] / t["s"], 1),
                   "speedup_vs_vanilla": round(t["tokens"] / t["s"] / base, 3), "identical": t["identical"],
                   "drafter": type(gens[name].drafter).__name__ if name in gens else "-"}
            for name, t in totals.items()}


def heads(lease) -> dict:
    """Phase 5: train both heads for the same minutes (the GPU tests beside them), then decode (P6)."""
    minutes = 0.05 if lease.smoke else 1.0
    jobs = start(lease, minutes)
    trained = finish(lease, jobs)
    result = {"train_minutes": minutes, "train": {k: trained[k] for k in CONFIGS}, "tests": trained["tests"]}
    done = [k for k in CONFIGS if trained[k]["exit"] == 0]
    if done and not lease.over():
        result["decode"] = decode(lease, done)
        speeds = {k: result["decode"][k]["tokens_per_s"] for k in done}
        result["winner_at_equal_training_time"] = max(speeds, key=speeds.get)
    return result


def _fmt(value, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def summary(results: dict) -> str:
    """The run on one screen: per phase its seconds against the estimate and its headline figures."""
    phases = results.get("phases", {})
    lines = [f"# GPU lease: {phases.get('probe', {}).get('device', '?')}  (wall {results.get('wall_s', '…')} s "
             f"of {results['budget_s']:.0f})", ""]
    for name, data in phases.items():
        lines.append(f"- {name}: {data.get('seconds')} s (estimate {data.get('estimate_s')} s)"
                     + (f"  ERROR {data['error']}" if "error" in data else ""))
        lines += [f"    {line}" for line in headline(name, data)]
    lines += [f"- {name}: skipped, {why}" for name, why in results.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


def headline(name: str, d: dict) -> list[str]:
    """A phase's figures worth one line each (P1, P2, P6, P7, P8)."""
    out = []
    if "copy_tb_per_s" in d:
        out.append(f"copy {d['copy_tb_per_s']} TB/s; torch {d['torch']}, transformers {d['transformers']}, "
                   f"fla {d['fla']}, datasets {d['datasets']}")
    if "t_over_t1" in d:
        out.append(f"P7 t(1) {_fmt(d['t_ms'][min(d['t_ms'])])} ms ({d['sweep_backend']}, "
                   f"{d.get('sweep_cudagraph_skips', 0)} graph skips) = {d['t1_over_hbm_bound']}x the HBM bound "
                   f"({_fmt(d['hbm_bound_ms'])} ms); t(N)/t(1) "
                   + ", ".join(f"{n}: {r}" for n, r in d["t_over_t1"].items()))
    rows = d.get("rows")
    for method, row in (rows.items() if isinstance(rows, dict) else []):
        out.append(f"P1/P2 {method}: {_fmt(row['tokens_per_s'], 1)} tok/s, tau {_fmt(row['tau'])}, "
                   f"{_fmt(row['speedup_vs_hf_static'])}x hf-static, efficiency {_fmt(row['efficiency'])}")
    if "head_draft_ms" in d:
        out.append(f"draft ms: {json.dumps(d['head_draft_ms'])}")
    for row in (rows if isinstance(rows, list) else []):
        out.append(f"P8 bs {row['batch_size']} {row['method']}: {_fmt(row['tokens_per_s'], 1)} tok/s, "
                   f"{_fmt(row['speedup_vs_hf_static'])}x, identical {row['identical']}")
    for kind, row in d.get("decode", {}).items():
        out.append(f"P6 {kind}: tau {row['tau']}, {row['tokens_per_s']} tok/s, {row['speedup_vs_vanilla']}x vanilla")
    if "tests" in d:
        out.append(f"tests: {d['tests'].get('last_line', d['tests'])}")
    if "rollback_share" in d:
        out.append(f"hybrid ({d['kernels']}, rollback {d['rollback']}): tau {d['tau']}, "
                   f"restore {d['rollback_share']:.1%} "
                   f"+ re-verified tokens {d['reverify_share']:.1%} of the step time")
    return out
