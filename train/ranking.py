"""How well a training-time metric ranks heads: real τ of each head per temperature (seeded decodes,
``infer.seeded_decode``) and Spearman's rank correlation of a metric with it (``draftsmith rank-heads``)."""
from __future__ import annotations

from draftsmith.train.settings import decode_tau_key


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (nan when either side has no spread)."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def real_taus(target, head, prompts, references, args) -> dict:
    """Per temperature: pooled τ with its interval, tokens/s and vLLM's acceptance of seeded decodes of ``prompts``
    (``real_tau``, ``real_tau_t<T>``, ...); ``identical``: every greedy decode equals its reference."""
    from draftsmith.infer.generator import SpeculativeGenerator
    from draftsmith.infer.seeded_decode import seeded_stats, tau_report
    from draftsmith.train.decode_tau import head_drafter

    # the head's own draft policy at every temperature, as decode τ (the CPU default's cost-aware choice at T > 0
    # follows this machine's step costs, not the head)
    gen, row = SpeculativeGenerator(target, head_drafter(head, target)), {"identical": True, "acceptance": {}}
    for t in args.temperatures:
        outs, stats = seeded_stats(gen, prompts, max_new_tokens=args.max_new_tokens, temperature=t,
                                   top_p=args.top_p, top_k=args.top_k)
        if t == 0:
            row["identical"] = all(o.shape == r.shape and bool((o == r).all()) for o, r in zip(outs, references))
        key = decode_tau_key(t, "real_tau")
        report = row["acceptance"][f"{t:g}"] = tau_report(stats, key)
        row.update({k: report[k] for k in (key, f"{key}_low", f"{key}_high")})
        for name in ("tokens_per_s", "mean_acceptance_length"):
            row[decode_tau_key(t, name)] = report[name]
    return row


def correlations(rows: list[dict], temperatures: list[float]) -> dict[str, float]:
    """Spearman of each training metric every row has with real τ at its temperature (simulated τ: the first)."""
    pairs = [("simulated_tau", decode_tau_key(temperatures[0], "real_tau"))]
    pairs += [(decode_tau_key(t), decode_tau_key(t, "real_tau")) for t in temperatures]
    return {m: spearman([r[m] for r in rows], [r[real] for r in rows]) for m, real in pairs
            if all(r.get(m) is not None for r in rows)}
