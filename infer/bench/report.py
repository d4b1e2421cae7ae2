"""Summary rows, markdown tables and plots of benchmark results.

One definition of speed everywhere: a method's tokens/s is all its new tokens over all its seconds
(each prompt's median over repeats), and every speedup is a ratio of those tokens/s, so a method
slower in tokens/s can never show as faster.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from draftsmith.data.base.paths import claim_report_dir
from draftsmith.infer.bench.batch import batch_markdown
from draftsmith.infer.bench.cost import bound as cost_bound
from draftsmith.infer.bench.methods import Method
from draftsmith.infer.decoding import GenerationStats
from draftsmith.infer.bench.profile import plot_profile, profile_markdown
from draftsmith.infer.bench.sampled import sampled_markdown

COLUMNS = (
    "Columns: tokens/s = new tokens / seconds over all prompts (each prompt's median over repeats); "
    "speedup and vs hf-static = ratios of those tokens/s; τ = tokens emitted per target forward after "
    "the prefill; fwd/token = target forwards per new token; tokens/verify = tokens each verification "
    "forward carried (the padded budget on the static path); bound = τ·t(1)/t*(N), the most a method "
    "with that τ and N can gain over one forward per token, with t*(N) the monotone envelope of the "
    "measured t(N); efficiency = (t(1) × tokens/s) / bound = t*(N) / measured seconds per step: the "
    "share of each step that is the verify forward itself (drafting, acceptance and host work take "
    "the rest)."
)


UNSTABLE = ("unstable: an efficiency above 100% cannot be (no step is shorter than its own verify forward); "
            "t(N) and the method's runs were timed at different load (a busy machine): rerun on an idle one")


def efficiency_cell(efficiency: float) -> str:
    """The efficiency as a percentage, or ``unstable`` where the timings contradict each other (> 100%)."""
    return "unstable" if efficiency > 1.0 else f"{efficiency:.0%}"


def unstable_note(efficiencies: list[float]) -> list[str]:
    """The footnote lines of a table that shows ``unstable`` (none when every efficiency is possible)."""
    return ["", UNSTABLE] if any(e > 1.0 for e in efficiencies) else []


def tokens_per_s(m: Method) -> float:
    """All new tokens over all seconds of ``m``'s runs."""
    return sum(r["new_tokens"] for r in m.runs) / sum(r["seconds"] for r in m.runs)


def pooled_acceptance(m: Method) -> dict:
    """vLLM's acceptance names of a generator method over its prompts (counts summed first; {} for HF's)."""
    if not m.runs or "acceptance" not in m.runs[0]:
        return {}
    stats = GenerationStats.pooled([GenerationStats(**r["acceptance"]) for r in m.runs])
    return {"acceptance": stats.acceptance(), "mean_acceptance_length": stats.mean_acceptance_length}


def summarise(methods: list[Method], costs: dict[int, float]) -> list[dict]:
    """One row per method (vanilla first): speeds, τ, the bound and efficiency (see ``COLUMNS``)."""
    vanilla = methods[0]
    static = next((m for m in methods if m.name == "hf-static"), None)
    t1 = costs[min(costs)]
    rows = []
    for m in methods:
        tps = tokens_per_s(m)
        tau = statistics.fmean(r["tau"] for r in m.runs)
        n_verify = statistics.fmean(r["verify_lengths_mean"] for r in m.runs)
        limit = cost_bound(tau, costs, n_verify)
        mem = [r["peak_mem_mb"] for r in m.runs if r["peak_mem_mb"] is not None]
        rows.append({
            "method": m.name,
            "tokens_per_s": tps,
            "speedup": tps / tokens_per_s(vanilla),
            "speedup_vs_hf_static": tps / tokens_per_s(static) if static else None,
            "tau": tau,
            "forwards_per_token": statistics.fmean(r["forwards"] / max(1, r["new_tokens"]) for r in m.runs),
            "tokens_per_verify": n_verify,
            "bound": limit,
            "efficiency": t1 * tps / limit if limit else float("nan"),
            "timings_unstable": bool(limit) and t1 * tps / limit > 1.0,  # see UNSTABLE
            "peak_mem_mb": max(mem) if mem else None,
            "identical": all(r["tokens"] == v["tokens"] for r, v in zip(m.runs, vanilla.runs)),
            **pooled_acceptance(m),
        })
    return rows


def markdown(rows: list[dict], costs: dict[int, float], meta: dict) -> str:
    """results.md: the methods table, what each column is, and the t(N) sweep."""
    lines = [
        f"Target `{meta['target']}` on {meta['hardware']}, {meta['dtype']}, {meta['num_prompts']} prompts × "
        f"{meta['repeats']} repeats, max_new_tokens={meta['max_new_tokens']}.",
        "",
        "| method | tokens/s | speedup | vs hf-static | τ | fwd/token | tokens/verify | bound | efficiency | peak MiB | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        mem = f"{r['peak_mem_mb']:.0f}" if r["peak_mem_mb"] is not None else "–"
        vs_static = f"{r['speedup_vs_hf_static']:.2f}×" if r.get("speedup_vs_hf_static") else "–"
        lines.append(
            f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | {vs_static} | {r['tau']:.2f} | "
            f"{r['forwards_per_token']:.2f} | {r['tokens_per_verify']:.1f} | {r['bound']:.2f}× | "
            f"{efficiency_cell(r['efficiency'])} | {mem} | {'yes' if r['identical'] else 'NO'} |"
        )
    lines += unstable_note([r["efficiency"] for r in rows])
    lines += [f"\nSkipped `{name}`: {reason}." for name, reason in meta.get("skipped", {}).items()]
    lines += ["", COLUMNS, "", "Verification cost t(N) / t(1):", "",
              "| N | " + " | ".join(str(n) for n in costs) + " |",
              "|---|" + "---:|" * len(costs),
              "| t(N)/t(1) | " + " | ".join(f"{costs[n] / costs[1]:.2f}" for n in costs) + " |",
              "", f"t(1) = {costs[1] * 1e3:.2f} ms."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], costs: dict[int, float], out: Path) -> None:
    """speedup_tau.png (speedup against the bound, and τ) and verification_cost.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2.5))
    axes[0].barh(names, [r["speedup"] for r in rows], color="tab:blue", label="measured")
    axes[0].scatter([r["bound"] for r in rows], names, color="tab:red", marker="|", s=300, label="bound τ·t(1)/t(N)")
    axes[0].axvline(1.0, color="gray", lw=0.8)
    axes[0].set_xlabel("speedup over vanilla greedy")
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    axes[0].invert_yaxis()
    axes[1].barh(names, [r["tau"] for r in rows], color="tab:green")
    axes[1].set_xlabel("τ: tokens per verification forward")
    axes[1].set_yticklabels([])
    axes[1].invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "speedup_tau.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    sizes = sorted(costs)
    ax.plot(sizes, [costs[n] / costs[1] for n in sizes], marker="o")
    ax.plot(sizes, sizes, ls="--", color="gray", label="linear (t(N) = N·t(1))")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens verified in one forward (N)")
    ax.set_ylabel("t(N) / t(1)")
    ax.legend()
    ax.set_title("verification cost vs tree size")
    fig.tight_layout()
    fig.savefig(out / "verification_cost.png", dpi=120)
    plt.close(fig)


def scale_markdown(result: dict) -> str:
    """results.md of ``scripts/bench_scale.py``."""
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
                     f"{efficiency_cell(r['efficiency'])} | {comp} | {mem} |")
    lines += unstable_note([r["efficiency"] for r in result["rows"].values()])
    costs = result["verify_cost_ms"]
    t1 = costs[min(costs, key=int)]
    lines += ["", "| N | " + " | ".join(str(n) for n in costs) + " |", "|---|" + "---:|" * len(costs),
              "| t(N) ms | " + " | ".join(f"{c:.2f}" for c in costs.values()) + " |",
              "| t(N)/t(1) | " + " | ".join(f"{c / t1:.2f}" for c in costs.values()) + " |"]
    if "eagle3_head_draft_ms" in result:
        lines += ["", "EAGLE-3 head at these dimensions, ms per draft: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in result["eagle3_head_draft_ms"].items())]
    return "\n".join(lines) + "\n"


def throughput_markdown(throughput: dict | None) -> str:
    """Head-training tokens/s against the target's forward-only tokens/s ("" without measurements)."""
    if not throughput:
        return ""
    table = "\nHead training throughput (tokens/s) vs the target's forward-only tokens/s:\n\n"
    table += "| head | train tokens/s | target forward tokens/s | ratio |\n|---|---:|---:|---:|\n"
    for kind, r in throughput.items():
        table += f"| {kind} | {r['train_tokens_per_s']:.0f} | {r['target_forward_tokens_per_s']:.0f} | {r['ratio']:.2f} |\n"
    return table


def write_report(out: Path, result: dict) -> None:
    """results.json, results.md and the plots of ``scripts/benchmark.py`` into ``out``; prints the table."""
    claim_report_dir(out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    rows, costs = result["rows"], result["verification_cost_s"]
    table = markdown(rows, costs, result["meta"]) + throughput_markdown(result.get("train_throughput"))
    table += batch_markdown(result.get("batch")) + sampled_markdown(result.get("sampled"))
    if result.get("profile"):
        table += "\n" + profile_markdown(result["profile"])
        plot_profile(result["profile"], out)
    (out / "results.md").write_text(table)
    plot(rows, costs, out)
    print(table)
    print(f"results in {out}/ (results.json, results.md, speedup_tau.png, verification_cost.png)")
