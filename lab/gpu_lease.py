"""The GPU proof in one leased call: at most 9 minutes on one H100 from a cold start, 64 MiB carried.

    python lab/gpu_lease.py --dry-run                  # on any machine: what travels, each phase's seconds
    python lab/gpu_lease.py --out $OUT                 # on the GPU (docs/benchmarks.md, "GPU: one command")
    python lab/gpu_lease.py --smoke --device cpu --out DIR   # every phase at tiny shapes, seconds on a CPU

Phases, in order (most value per device second first; ``lab/lease_phases.py``):

1. ``probe``: the device, torch / transformers, the measured device-to-device copy rate (the HBM bound);
2. ``shape-llama3.1-8b``: random bf16 weights at the real shape (``infer.bench``, as ``scripts/bench_scale.py``):
   HF ``generate`` with the static cache, our generator (static cache, compiled, CUDA graphs) with an oracle at
   τ 5 (a chain of 4) and τ 3 (2 true drafts + 2 decoys, the same compiled N = 5), t(N) for N up to 64, t(1)
   against the HBM bound, a random EAGLE-3 head's and DFlash head's draft cost at the GPU defaults (P1, P2, P7);
3. ``shape-qwen3-8b``: t(1) against the HBM bound and t(N)/t(1) at Qwen3-8B's shape (P7);
4. ``batch``: batch speculation (the oracle, eager: a batch decodes eager) at bs 4 and 16 against HF batched
   static at the 8B shape; bs 1 is phase 2's row (P8);
5. ``heads``: demo:tiny EAGLE-3 and DFlash heads trained side by side for the same minutes, then decoded with
   the GPU defaults (EAGLE-3's dynamic tree, DFlash's full block): τ and speedup against vanilla (P6); the
   CUDA-only tests (``pytest -m gpu``) run beside the training (correctness only, no timing);
6. ``hybrid``: a Gated DeltaNet hybrid at Qwen3.5-9B's shape (fla's kernels when ``fla-core`` travels, else
   transformers' torch reference): t(N)/t(1) and the rollback's share of the step time.

Each phase is estimated from ``lab/gpu_lease_rates.json`` (seconds per unit of work, each with its source);
a phase starts only if its estimate fits in what is left of ``--budget-s`` (else it is skipped with a note), and
``results.json`` / ``summary.md`` in ``--out`` are rewritten as each phase ends, so a cut run leaves what it had.
A phase that fails is recorded with its error and the next one runs. ``--dry-run`` prints what would travel
(git's tracked + untracked-not-ignored files + ``--wheels``) and the plan, and exits 1 if the plan passes the
budget or the carry passes 64 MiB. ``--smoke``: the same phases at tiny shapes with seconds-scale budgets.
The real-model report (SmolLM2, several calls) is ``lab/gpu_report.py --real``.
"""
from __future__ import annotations

import time

STARTED = time.monotonic()  # the budget counts from here: the imports below and torch's are part of the run

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from draftsmith.data.base.checks import cli_real  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RATES = Path(__file__).with_name("gpu_lease_rates.json")
MIB = 2 ** 20

# phase -> its cost in units of the rates: {rate: count}, in the order the phases run
PHASES: dict[str, dict[str, float]] = {
    "probe": {"python_start_s": 1, "probe_s": 1, "write_s": 1},
    "shape-llama3.1-8b": {"build_8b_s": 1, "hf_static_compile_s": 1, "inductor_verify_compile_s": 1,
                          "cudagraphs_verify_capture_s": 3, "head_draft_compile_s": 2, "shape_runs_s": 1,
                          "write_s": 1},
    "shape-qwen3-8b": {"build_8b_s": 1, "cudagraphs_verify_capture_s": 3, "write_s": 1},
    "batch": {"hf_static_compile_s": 2, "batch_runs_s": 1, "write_s": 1},
    "heads": {"demo_train_start_s": 1, "demo_train_s": 1, "demo_decode_s": 1, "write_s": 1},
    "hybrid": {"hybrid_build_s": 1, "hybrid_kernels_s": 1, "hybrid_runs_s": 1, "write_s": 1},
}


def load_rates(path: Path) -> dict:
    """The rates file, checked: every rate a phase names is there with a number and a source."""
    data = json.loads(Path(path).read_text())
    rates = data.get("rates", {})
    for phase, cost in PHASES.items():
        for name in cost:
            entry = rates.get(name)
            numeric = isinstance(entry, dict) and isinstance(entry.get("value"), (int, float))
            if not numeric or not entry.get("source"):
                raise ValueError(f"{path}: rates.{name} (used by phase {phase}) needs a numeric 'value' and a 'source'")
    return data


def estimates(rates: dict) -> dict[str, float]:
    """Seconds per phase: each rate's value times its count."""
    return {phase: sum(rates["rates"][name]["value"] * count for name, count in cost.items())
            for phase, cost in PHASES.items()}


def carried_files(root: Path) -> list[tuple[str, int]]:
    """(path, bytes) of what the device tool sends: git's tracked files and untracked files it does not ignore."""
    listed = []
    for extra in ([], ["--others", "--exclude-standard"]):
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", *extra], capture_output=True, check=True)
        listed += [name for name in out.stdout.decode().split("\0") if name]
    files = []
    for name in sorted(set(listed)):
        path = root / name
        if path.is_symlink():
            files.append((name, len(os.readlink(path))))  # a link travels as a link
        elif path.is_file():
            files.append((name, path.stat().st_size))
    return files


def wheel_files(wheels: Path, rates: dict) -> tuple[list[tuple[str, int]], bool]:
    """(name, bytes) of the wheels that travel in ``wheels`` (carried), and whether they are on disk; when the
    folder holds none yet, the recorded sizes of the wheels the phases need (rates' ``wheels``)."""
    found = sorted((p.name, p.stat().st_size) for p in wheels.glob("*") if p.is_file()) if wheels.is_dir() else []
    if found:
        return found, True
    return [(name, size) for name, size in rates.get("wheels", {}).items() if name.endswith(".whl")], False


def dry_run(args, rates: dict) -> int:
    """Print what travels and each phase's estimate; 1 when either passes its limit, else 0."""
    files = carried_files(args.root)
    wheels, on_disk = wheel_files(args.wheels, rates)
    repo_bytes, wheel_bytes = sum(s for _, s in files), sum(s for _, s in wheels)
    limit = rates["carry_limit_bytes"]
    print(f"carried: {len(files)} repository files {repo_bytes / MIB:.2f} MiB (git tracked + untracked-not-ignored)")
    for name, size in sorted(files, key=lambda f: -f[1])[:5]:
        print(f"  {size / MIB:8.2f} MiB  {name}")
    print(f"  + {args.wheels.name}/ ({'on disk' if on_disk else 'recorded sizes, not downloaded yet'}): "
          f"{wheel_bytes / MIB:.2f} MiB")
    for name, size in wheels:
        print(f"  {size / MIB:8.2f} MiB  {name}")
    total = repo_bytes + wheel_bytes
    print(f"carry total {total / MIB:.2f} MiB of {limit / MIB:.0f} MiB")
    plan = estimates(rates)
    for phase, seconds in plan.items():
        print(f"  {phase:<20} {seconds:6.1f} s  ({', '.join(f'{n} x{c:g}' for n, c in PHASES[phase].items())})")
    for name, entry in rates["rates"].items():
        print(f"    {name:<28} {entry['value']:>6g}  {entry['source'][:100]}")
    budget = min(args.budget_s, rates["budget_s"])
    print(f"plan total {sum(plan.values()):.1f} s of {budget:.0f} s")
    failures = []
    if total > limit:
        failures.append(f"the carry is {total / MIB:.2f} MiB, over {limit / MIB:.0f} MiB")
    if sum(plan.values()) > budget:
        failures.append(f"the plan takes {sum(plan.values()):.1f} s, over {budget:.0f} s")
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="the one output folder (at most 8 files)")
    p.add_argument("--dry-run", action="store_true", help="print the carry and the plan; exit 1 past a limit")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and seconds-scale budgets (a CPU check)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--budget-s", type=cli_real(0, above=True), default=540.0, help="seconds for the whole run")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run, of " + ", ".join(PHASES))
    p.add_argument("--sweep-backend", choices=("cudagraphs", "inductor", "eager"), default="cudagraphs",
                   help="how the t(N) sweep's verify steps compile on CUDA (inductor: ~50 s per N at 8B)")
    p.add_argument("--rates", type=Path, default=RATES, help="the rates file the plan reads")
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="the carried wheel folder (counted by --dry-run)")
    p.add_argument("--root", type=Path, default=REPO, help="the repository that travels (counted by --dry-run)")
    args = p.parse_args(argv)
    args.phases = [name.strip() for name in args.phases.split(",") if name.strip()]
    unknown = [name for name in args.phases if name not in PHASES]
    if unknown:
        p.error(f"--phases: unknown {', '.join(unknown)}; of {', '.join(PHASES)}")
    if not args.dry_run and args.out is None:
        p.error("--out is needed (the output folder), or --dry-run")
    return args


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The dry run, or every phase in turn (``lab/lease_phases.py``) within the budget counted from ``started``
    (a ``time.monotonic()``; the process's start when run as a script, else now); the exit code."""
    started = time.monotonic() if started is None else started
    args = parse_args(argv)
    rates = load_rates(args.rates)
    if args.dry_run:
        return dry_run(args, rates)
    from draftsmith.lab.lease_phases import run_lease

    return run_lease(args, estimates(rates), started)


if __name__ == "__main__":
    from draftsmith.data.entry_point import run

    sys.exit(run(lambda argv: main(argv, STARTED)))
