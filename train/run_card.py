"""A run's README.md: the head's model card plus this run's data and results."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from draftsmith.train.checkpoint import BEST
from draftsmith.train.resume import TrainState


def run_card(head: nn.Module, output_dir: Path, data_summary, final: dict, state: TrainState, vocab) -> str:
    """README.md: ``heads.card`` (target, inputs, training record, usage) plus this run's data and results."""
    from draftsmith.heads.card import model_card, training_info

    lines = ["## This run", ""]
    if final:
        decoded = f"decode τ {final['decode_tau']:.3f}, " if "decode_tau" in final else ""
        lines.append(f"- this directory holds the **final** head: {decoded}simulated τ {final['tau']:.3f} at step {state.step} "
                     f"(acc_k {', '.join(f'{a:.3f}' for a in final['acc'])})")
        by = final.get("best_by", "tau")
        by = "simulated τ" if by == "tau" else f"decode τ at T = {by[12:] or 0}"  # decode_tau, decode_tau_t<T>
        lines.append(f"- the best head by {by} ({state.best_tau:.3f}, step {state.best_step}) is in `{BEST}/`")
    lines.append(f"- {state.step} optimizer steps, {state.tokens} training tokens")
    if vocab is not None:
        lines.append(f"- draft vocabulary: {head.config.draft_vocab_size} most frequent training targets, covering "
                     f"{100 * vocab.coverage:.1f}% of them")
    summary = [line for line in str(data_summary).splitlines() if not line.startswith("cache ")]  # a local path
    lines += ["- training data:", "", "```", *summary, "```", ""]
    return model_card(head, training=training_info(output_dir)) + "\n" + "\n".join(lines)
