"""Held-out simulated τ against training step for several runs, on one plot.

    draftsmith plot-runs --runs runs/a runs/b [--labels A B] --out docs/plot.png

Reads each run's ``metrics.jsonl`` (the evaluation records, those with ``tau``); a run with none is
named in a one-line error. Prints each run's last and best τ. ``--out`` is a new file or a plot this
script wrote (marked in the PNG's ``Software`` text); any other file there is refused, never replaced.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.data.base.paths import claim_report_file

PLOT_SOFTWARE = "draftsmith scripts/plot_runs.py"

def tau_curve(run: Path) -> list[tuple[int, float]]:
    """(step, simulated τ) of a run's evaluation records, in order."""
    log = Path(run) / "metrics.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{run}: no metrics.jsonl (not a training run's output_dir)")
    curve = []
    for number, line in enumerate(log.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            raise ValueError(f"{log}: line {number} is not JSON") from None
        if isinstance(record, dict) and "tau" in record:
            curve.append((int(record["step"]), float(record["tau"])))
    if not curve:
        raise ValueError(f"{log}: no evaluation records (train with data.eval set and train.eval_every > 0)")
    return curve


def _our_plot(path: Path) -> bool:
    """Whether ``path`` is a PNG this script wrote (its ``Software`` text chunk)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.info.get("Software") == PLOT_SOFTWARE
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, type=Path, help="training output directories")
    p.add_argument("--labels", nargs="*", help="one legend label per run (default: the directory names)")
    p.add_argument("--out", required=True, type=Path, help="PNG file to write")
    p.add_argument("--title", default="held-out simulated τ")
    args = p.parse_args(argv)
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        p.error(f"--labels gives {len(labels)} labels for {len(args.runs)} runs")
    if args.out.suffix.lower() != ".png":
        p.error(f"--out {args.out}: name a .png file")
    claim_report_file(args.out, _our_plot, "plot")
    curves = [tau_curve(run) for run in args.runs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, curve in zip(labels, curves):
        ax.plot(*zip(*curve), marker="o", markersize=3, label=label)
        print(f"{label}: last τ {curve[-1][1]:.3f} (step {curve[-1][0]}), best {max(t for _, t in curve):.3f}")
    ax.set_xlabel("training step")
    ax.set_ylabel("simulated τ (held-out)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110, metadata={"Software": PLOT_SOFTWARE})
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
