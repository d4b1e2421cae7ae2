"""Throughput of the data pipeline on a synthetic multi-turn conversation file.

    python lab/bench_data_pipeline.py [--rows 10000] [--max-length 2048] [--seed 0]

Writes a JSONL file of ``--rows`` conversations (optional system prompt, 1-4 user/assistant
exchanges) to a temp dir, trains the demo ChatML tokenizer on part of it, then times
``build_examples`` cold (empty cache) and warm (cache hit) for both mask methods: the template's
``{% generation %}`` markers, and prefix diffing (same template with the markers removed, so the
examples must be identical).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.data.base.checks import cli_count
from draftsmith.data.pipeline import build_examples
from draftsmith.data.tokenizer import train_tokenizer

WORDS = (
    "the a model token draft head tree verify accept cache layer python list dict function value "
    "returns loop data train test fast slow small large because when then with without each every"
).split()
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a Python expert. Be precise.")


def sentence(rng: random.Random, n_min: int, n_max: int) -> str:
    """A random sentence of ``n_min``..``n_max`` words from the fixed word list."""
    words = rng.choices(WORDS, k=rng.randint(n_min, n_max))
    return " ".join(words).capitalize() + rng.choice(".?!")


def synthetic_row(rng: random.Random) -> dict:
    """A random multi-turn conversation row (an optional system turn, 1-4 user/assistant turns)."""
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": sentence(rng, 5, 30)})
        answer = " ".join(sentence(rng, 5, 25) for _ in range(rng.randint(1, 6)))
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def timed(path: Path, tokenizer, cache_dir: Path, max_length: int) -> tuple[float, object, object]:
    """(seconds, dataset, summary) of one ``build_examples`` call on ``path``."""
    start = time.perf_counter()
    dataset, summary = build_examples(path, tokenizer, max_length=max_length, cache_dir=cache_dir)
    return time.perf_counter() - start, dataset, summary


def main() -> None:
    """Write the synthetic file, then time a cold build and a cached rebuild with each mask method
    (template markers, prefix diff), check both give the same examples; print rows/s and tokens/s."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=cli_count(), default=10_000)
    parser.add_argument("--max-length", type=cli_count(), default=2048)
    parser.add_argument("--seed", type=cli_count(0), default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    rows = [synthetic_row(rng) for _ in range(args.rows)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conversations.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        texts = [m["content"] for r in rows[:1000] for m in r["messages"]]
        tokenizer = train_tokenizer(texts, vocab_size=1024)
        print(f"{args.rows} rows, {path.stat().st_size / 1e6:.1f} MB, vocab {len(tokenizer)}")

        reference = None
        for method in ("generation", "prefix_diff"):
            if method == "prefix_diff":
                markers = r"\{%-?\s*(end)?generation\s*-?%\}"
                tokenizer.chat_template = re.sub(markers, "", tokenizer.chat_template)
            cache_dir = Path(tmp) / f"cache-{method}"
            for phase in ("cold", "warm"):
                seconds, dataset, summary = timed(path, tokenizer, cache_dir, args.max_length)
                if summary.mask_method != method or summary.cache_hit != (phase == "warm"):
                    raise RuntimeError(f"expected a {phase} {method} run, got {summary}")
                print(
                    f"{method:11s} {phase}: {seconds:6.2f} s  {summary.rows_in / seconds:8.0f} rows/s  "
                    f"{summary.tokens / seconds:10.0f} tokens/s"
                )
            reference = dataset if reference is None else reference
            same = all(dataset[c] == reference[c] for c in ("input_ids", "loss_mask"))
            if not same:
                raise RuntimeError(f"{method} examples differ from the generation-marker examples")
        print(summary)


if __name__ == "__main__":
    from draftsmith.data.entry_point import run  # user mistakes: one line, exit code 2

    sys.exit(run(lambda argv: main()))
