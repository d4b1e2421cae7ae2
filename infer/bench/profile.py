"""Where a speculative step's time goes: the generator's phase clock, per head method."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.infer.bench.methods import Method

LOOP_PHASES = ("draft", "observe", "verify", "accept", "compact", "rollback", "emit")  # rollback: hybrid targets only



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
    """The phase table, milliseconds per verification step."""
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
    """profile.png: stacked phases per method against one vanilla token."""
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
