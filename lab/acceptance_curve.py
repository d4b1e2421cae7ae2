"""Acceptance against training budget: simulated τ, real τ and ``--compare`` speedup per recipe and step count.

    python lab/acceptance_curve.py [--budgets 300,1200,4800]
        [--recipes eagle3,dflash-old,dflash-new,dflash-dpace,peagle,dspark]
        [--on-policy-steps N] [--target demo:tiny] [--prompt "class Queue:"] [--max-new-tokens 96] [--rounds 3]
        [--temperatures 0,0.7,1] [--runs runs/acceptance-curve] [--out docs/acceptance-curve]
        [--phase all|train|measure] [--set key=value ...]

Per budget and recipe (``RECIPES``: a config file and its overrides, all on the demo's self-distilled data,
``SELF_DISTILLED``) it trains a head for that many steps, then continues it with the on-policy stage
(``train.stage=on-policy``, ``--on-policy-steps``, default a quarter of the budget) as ``<recipe>+opd``, and
continues it as much without the rollout as ``<recipe>+sup``: its supervised control (the same steps, loss, lr,
warm-up and anchors; ``CONTROL``), so the stage's gain is read against the same steps spent supervised
(``SUPERVISED_ONLY`` recipes, P-EAGLE's and DSpark's, have neither).
Each head is measured three ways: the held-out simulated τ of training's evaluation, and one greedy decode
of ``--prompt`` against the target's own ``generate`` (``infer.generate_command``'s ``--compare``: ``--rounds``
rounds alternating, the same process), at each of ``--temperatures`` (default 0, 0.7 and 1; at T > 0 against the
target's sampled ``generate``, every round from the prompt's seed, ``infer.seeded_decode.prompt_seed``): its τ
(tokens per target forward; ``tau``, ``tau_t0.7``, ...), tokens/s, speedup and vLLM's mean acceptance length. Writes
results.json (after every head: a long run keeps what it measured), curve.md and curve.png to ``--out``.
``--set`` overrides go to every training run (after the recipe's). Heads go to ``--runs``.

``--phase train`` only trains (at low priority beside other work, say) and ``--phase measure`` measures the
heads results.json lists later, on a quiet machine: the speedups are timings, the training is not. Either phase
skips what results.json already holds, so an interrupted run continues where it stopped: a row records the
code's revision (``git rev-parse HEAD``, or the installed version outside a clone) and every setting it was
trained and measured with, and is reused only when both equal this run's; any other row is redone.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_temperatures

ROOT = Path(__file__).resolve().parents[1]
# The demo's self-distilled data (configs/demo.yaml): the target continues 768 stdlib chunks greedily, once, cached
SELF_DISTILLED = ["data.self_distill.rows=768", "data.self_distill.max_new_tokens=224",
                  "data.self_distill.prompt_tokens=32", "data.self_distill.batch_size=128"]
# The DFlash recipe before issue 33: blocks of 8, 2 layers, a 0.8 decay per block position (gamma = -1/ln 0.8)
OLD_GAMMA = -1 / math.log(0.8)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "eagle3": ("configs/demo.yaml", []),
    "dflash-old": ("configs/demo-dflash.yaml", ["head.block_size=8", "head.num_layers=2", f"train.gamma={OLD_GAMMA}"]),
    "dflash-new": ("configs/demo-dflash.yaml", ["head.block_size=16", "head.num_layers=5", "train.gamma=null"]),
    "dflash-dpace": ("configs/demo-dflash.yaml", ["head.block_size=16", "head.num_layers=5", "train.gamma=null",
                                                  "train.loss=dpace"]),
    # P-EAGLE: configs/demo.yaml's EAGLE-3 recipe without its post-norm state (vLLM's P-EAGLE reader drops it)
    "peagle": ("configs/demo.yaml", ["head.variant=peagle", "head.num_depths=8", "head.norm_output=false"]),
    # DSpark: the new DFlash recipe with DSpark's Markov (rank 256) and confidence heads and DeepSpec's loss
    # (0.1 CE + 0.9 L1 + 1.0 confidence BCE, gamma 7 at blocks of 16; docs/dflash.md, "DSpark")
    "dspark": ("configs/demo-dflash.yaml", ["head.block_size=16", "head.num_layers=5", "train.gamma=null",
                                            "head.variant=dspark"]),
    # Domino: dflash-new plus its GRU correction, sized for the demo target (hidden 192, 4096 tokens; the engines'
    # 1024-wide GRU and 256-wide correction are sized for 4096-wide targets: docs/dflash.md)
    "domino": ("configs/demo-dflash.yaml", ["head.block_size=16", "head.num_layers=5", "train.gamma=null",
                                            "head.variant=domino", "head.gru_hidden_dim=64", "head.emb_dim=64"]),
}
# Recipes that train no on-policy stage: P-EAGLE refuses it (its depths are no TTT chain), DSpark too (the
# stage's CE rollout would not train its Markov and confidence heads, and DeepSpec has no such stage), and
# Domino (the stage would not train its GRU correction); no +opd/+sup rows
SUPERVISED_ONLY = {"peagle", "dspark", "domino"}
# The stage has its own loss (train.loss=ce is required: it overrides a D-PACE recipe's loss), on the target's law
# (train.labels=soft: it overrides the EAGLE-3 demo recipe's top-1 labels, which the stage refuses)
ON_POLICY = ["train.stage=on-policy", "train.loss=ce", "train.labels=soft", "train.warmup_steps=5",
             "train.anchors_per_document=8"]
# The stage continues a head whose schedule ended at lr 0: restarting it at the recipe's lr undid the head
# (a 300-step DFlash fell from simulated tau 3.94 to 1.97 within 75 steps at 3e-3, EAGLE-3 from 5.87 to 5.60 at
# 1e-3, acc_k at step 10 already 0.14 against 0.58); it runs at this fraction of the recipe's lr. Most of
# DFlash's fall was the stage training block positions after a rejection towards the law after its wrong drafts
# (fixed: 3.94 -> 4.10 at 3e-4, 3.97 at 3e-3; docs/objectives.md). EAGLE-3 held its tau only at 1e-5 (5.866 ->
# 5.890; 5.778 at 1e-4): a hundredth of its recipe's lr.
ON_POLICY_LR_FRACTION = {"eagle3": 0.01, "dflash": 0.1}
# The stage's supervised control: ON_POLICY without the rollout (the same loss, warm-up and, for DFlash, anchors;
# EAGLE-3's supervised loss reads every position, its anchors only root the stage's chains)
CONTROL = {"eagle3": ["train.loss=ce", "train.labels=soft", "train.warmup_steps=5"],
           "dflash": [o for o in ON_POLICY if o != "train.stage=on-policy"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="300,1200,4800", help="comma-separated training steps")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--on-policy-steps", type=cli_count(0), default=None,
                   help="steps of the on-policy stage after each head (default: a quarter of its budget; 0 = none)")
    p.add_argument("--target", default="demo:tiny")
    p.add_argument("--prompt", default="class Queue:")
    p.add_argument("--max-new-tokens", type=cli_count(), default=96)
    p.add_argument("--rounds", type=cli_count(), default=3)
    p.add_argument("--temperatures", type=cli_temperatures, default=[0.0, 0.7, 1.0],
                   help="comma-separated temperatures each head is measured at (0 = greedy)")
    p.add_argument("--runs", type=Path, default=Path("runs/acceptance-curve"))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "acceptance-curve")
    p.add_argument("--phase", choices=("all", "train", "measure"), default="all",
                   help="train and measure (all), only train, or only measure the heads results.json lists")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        args.budgets = [int(b) for b in args.budgets.split(",")]
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: expected comma-separated integers, e.g. 300,1200")
    if not args.budgets or min(args.budgets) < 1:
        p.error(f"--budgets {args.budgets}: every budget must be >= 1")
    args.recipes = args.recipes.split(",")
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"--recipes: unknown {unknown[0]!r}; expected some of {', '.join(RECIPES)}")
    return args


def train(config: str, overrides: list[str]):
    """One training run in this process (``train.run.setup``)."""
    from draftsmith.train.config import load_config
    from draftsmith.train.run import setup

    return setup(load_config(ROOT / config, overrides))


def measure(target: str, head_dir: Path, prompt: str, max_new_tokens: int, rounds: int,
            temperatures: list[float] = (0.0,)) -> dict:
    """Real τ, tokens/s, speedup and vLLM's mean acceptance length of decodes of ``prompt`` at each temperature, as
    ``python -m draftsmith.infer.generate_command --compare`` measures them (T > 0: against the target's sampled
    ``generate``, both from the prompt's seed); keys ``tau``, ``speedup``, ... at 0 (and ``identical``), with
    ``_t<T>`` after them at T > 0."""
    import torch

    from draftsmith.infer.generate_command import compare_rounds, encode
    from draftsmith.infer.generator import SpeculativeGenerator
    from draftsmith.infer.seeded_decode import prompt_seed
    from draftsmith.train.settings import decode_tau_key

    gen = SpeculativeGenerator.from_pretrained(target, str(head_dir), device="cpu")
    ids = encode(gen.tokenizer, prompt, False)
    gen.generate(ids, max_new_tokens=4)  # warm-up
    pad = gen.tokenizer.pad_token_id if gen.tokenizer.pad_token_id is not None else gen.tokenizer.eos_token_id
    with torch.inference_mode():
        gen.target.generate(ids, max_new_tokens=4, attention_mask=torch.ones_like(ids), pad_token_id=pad)  # warm-up
    row: dict = {"measured_at": list(temperatures)}
    for t in temperatures:
        hf = {"attention_mask": torch.ones_like(ids), "pad_token_id": pad, "do_sample": t > 0,
              **({"temperature": t, "top_k": 0} if t > 0 else {})}
        spec, vanilla = compare_rounds(gen, ids, max_new_tokens, rounds, prompt_seed(ids), {"temperature": t}, hf)
        for name, value in (("tau", gen.last_stats.tau), ("tokens_per_s", spec.tokens_per_s),
                            ("speedup", spec.tokens_per_s / vanilla.tokens_per_s),
                            ("mean_acceptance_length", gen.last_stats.mean_acceptance_length)):
            row[decode_tau_key(t, name)] = value
        if t == 0:
            row["identical"] = spec.output_equal_to(vanilla)
    return row


def recipe_kind_lr(config: str, overrides: list[str]) -> tuple[str, float]:
    """The recipe's head kind and the on-policy stage's learning rate: ``ON_POLICY_LR_FRACTION`` of its kind
    times the recipe's ``train.lr``."""
    from draftsmith.train.config import load_config

    cfg = load_config(ROOT / config, overrides)
    return cfg.head.kind, ON_POLICY_LR_FRACTION[cfg.head.kind] * cfg.train.lr


def stages(args: argparse.Namespace, budget: int, name: str,
           recipes: dict[str, tuple[str, list[str]]]) -> list[tuple[str, str, list[str]]]:
    """(label, config file, overrides) of a recipe's training at ``budget``, of its on-policy continuation and
    of that continuation's supervised control."""
    config, recipe = recipes[name]
    base = [f"target={args.target}", *SELF_DISTILLED, *recipe, f"train.max_steps={budget}",
            "train.eval_every=0", "train.save_every=0", "overwrite_output_dir=true"]
    out = [(name, config, [*base, f"output_dir={args.runs / f'{name}-{budget}'}", *args.overrides])]
    steps = max(1, budget // 4) if args.on_policy_steps is None else args.on_policy_steps
    if steps and name not in SUPERVISED_ONLY:
        kind, lr = recipe_kind_lr(config, [*recipe, *args.overrides])
        for suffix, stage in (("+opd", ON_POLICY), ("+sup", CONTROL[kind])):
            out.append((f"{name}{suffix}", config, [
                *base, *stage, f"train.lr={lr:g}", f"train.init_from={args.runs / f'{name}-{budget}'}",
                f"output_dir={args.runs / f'{name}{suffix}-{budget}'}", *args.overrides, f"train.max_steps={steps}"]))
    return out


def code_revision() -> str:
    """The code a row was made with: ``git rev-parse HEAD`` of this clone, else the installed version."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip()
    from importlib.metadata import version

    return f"draftsmith {version('draftsmith')}"


def read_rows(results: Path) -> list[dict]:
    """results.json's rows; a file this script did not write is refused in one line (never overwritten)."""
    if not results.exists():
        return []
    try:
        rows = json.loads(results.read_text())
    except ValueError as err:
        raise ValueError(f"{results}: not JSON ({err}); pass another --out") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"recipe", "budget"} <= r.keys() for r in rows):
        raise ValueError(f"{results}: not the rows of an acceptance curve (a list of objects with 'recipe' and "
                         "'budget'); pass another --out")
    return rows


def run_curve(args: argparse.Namespace, recipes: dict[str, tuple[str, list[str]]] = RECIPES) -> list[dict]:
    """Train and measure every (budget, recipe), its on-policy continuation and that one's control (or one
    ``--phase`` of it); rows already in ``--out``/results.json with this revision and these settings are kept,
    not redone. Returns the result rows."""
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: not a folder")
    results = args.out / "results.json"
    rows = read_rows(results)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = code_revision()
    measuring = {"target": args.target, "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                 "rounds": args.rounds, "temperatures": args.temperatures}
    for budget in args.budgets:
        for name in args.recipes:
            for label, config, overrides in stages(args, budget, name, recipes):
                settings = {"config": config, "overrides": overrides, **measuring}
                row = next((r for r in rows if (r["recipe"], r["budget"]) == (label, budget)), None)
                if row is not None and (row.get("commit"), row.get("settings")) != (commit, settings):
                    rows.remove(row)  # another revision or other settings: redone, never reused
                    row = None
                if row is None and args.phase != "measure":
                    start = time.perf_counter()
                    result = train(config, overrides)
                    row = {"recipe": label, "budget": budget, "steps": result.steps, "head": str(result.output_dir),
                           "train_minutes": (time.perf_counter() - start) / 60,
                           "simulated_tau": result.metrics.get("tau"), "commit": commit, "settings": settings}
                    rows.append(row)
                if row is not None and "measured_at" not in row and args.phase != "train":
                    row.update(measure(args.target, Path(row["head"]), args.prompt, args.max_new_tokens, args.rounds,
                                       args.temperatures))
                if row is not None:
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    results.write_text(json.dumps(rows, indent=1) + "\n")  # a long run keeps what it has
    measured = [r for r in rows if "measured_at" in r]
    if measured:
        write_table(measured, args, args.out / "curve.md")
        plot(measured, args.out / "curve.png")
    return rows


def write_table(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    from draftsmith.train.settings import decode_tau_key

    command = "python lab/acceptance_curve.py " + " ".join(
        [f"--budgets {','.join(map(str, args.budgets))}", f"--recipes {','.join(args.recipes)}",
         *([f"--on-policy-steps {args.on_policy_steps}"] if args.on_policy_steps is not None else []),
         f"--temperatures {','.join(f'{t:g}' for t in args.temperatures)}",
         f"--target {args.target}", *([f"--set {' '.join(args.overrides)}"] if args.overrides else [])])
    temps = args.temperatures
    lines = [f"# Acceptance against training steps ({args.target})", "", f"`{command}`", "",
             f"Real τ, tokens/s and speedup: decodes of `{args.prompt}`, {args.max_new_tokens} new tokens, "
             f"{args.rounds} rounds alternating with the target's own `generate` (greedy at T = 0, sampled from the "
             "prompt's seed at T > 0).", "",
             "`+opd`: the on-policy stage; `+sup`: its control, the same steps, loss and lr without the rollout.", "",
             "| recipe | budget | steps | train min | simulated τ | "
             + " | ".join(f"real τ T={t:g} | tokens/s T={t:g} | speedup T={t:g}" for t in temps)
             + " | identical | commit |",
             "|---|---:|---:|---:|---:|" + "---:|---:|---:|" * len(temps) + "---|---|"]

    def cell(r: dict, name: str, t: float, form: str) -> str:
        value = r.get(decode_tau_key(t, name))
        return "—" if value is None else format(value, form)

    for r in rows:
        sim = "—" if r["simulated_tau"] is None else f"{r['simulated_tau']:.3f}"
        measured = " | ".join(f"{cell(r, 'tau', t, '.2f')} | {cell(r, 'tokens_per_s', t, '.1f')} | "
                              f"{cell(r, 'speedup', t, '.2f')}×" for t in temps)
        same = "—" if "identical" not in r else "yes" if r["identical"] else "NO"
        lines.append(f"| {r['recipe']} | {r['budget']} | {r['steps']} | {r['train_minutes']:.1f} | {sim} | "
                     f"{measured} | {same} | {r.get('commit', '—')[:12]} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = [r for r in rows if r["recipe"] == recipe]
        budgets = [r["budget"] for r in mine]
        style = {"+opd": "--", "+sup": ":"}.get(recipe[-4:], "-")
        for ax, key in zip(axes, ("simulated_tau", "tau", "speedup")):
            ax.plot(budgets, [float("nan") if r.get(key) is None else r[key] for r in mine], style, marker="o",
                    label=recipe)
    for ax, title in zip(axes, ("simulated τ (held-out)", "real τ (--compare)", "speedup (--compare)")):
        ax.set_xscale("log")
        ax.set_xlabel("training steps (on-policy: + its own steps)")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    run_curve(parse_args(argv))
    return 0


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(main))
