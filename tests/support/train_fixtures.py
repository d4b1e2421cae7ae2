"""Shared pieces of the training tests (no tests here): a tiny target with its own tokenizer,
text data as .jsonl, and a config builder. Import the fixture into a test module to use it."""
from __future__ import annotations

import json
import random
import string
import textwrap
from pathlib import Path

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.train.config import TrainConfig, load_config

MAX_LENGTH = 48


def source_texts() -> list[str]:
    """Deterministic text: a few stdlib modules' source."""
    import inspect

    return [inspect.getsource(m) for m in (textwrap, string, random)]


def save_tiny_target(directory: Path, tokenizer, *, num_layers: int = 6, seed: int = 0) -> Path:
    """A random tiny Llama for ``tokenizer`` with a sharpened lm_head, saved with the tokenizer.

    Scaling the lm_head makes next-token distributions peaked (a random init is nearly uniform),
    so there is something for a head to learn and losses can fall.
    """
    model = make_tiny_target("llama", vocab_size=len(tokenizer), num_layers=num_layers,
                             max_position_embeddings=128, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory) -> dict[str, Path]:
    """{"target", "train", "eval"} paths shared by the training tests."""
    root = tmp_path_factory.mktemp("tiny_train")
    tokenizer = train_tokenizer(source_texts(), vocab_size=300)
    save_tiny_target(root / "target", tokenizer)
    return write_text_files(root)


def write_text_files(root: Path) -> dict[str, Path]:
    """The training text as .jsonl beside a target saved at ``root / "target"``: {"target", "train", "eval"}."""
    texts = source_texts()
    chunks = [c for t in texts for c in t.split("\n\n") if len(c) > 120]
    random.Random(0).shuffle(chunks)
    files = {"target": root / "target", "train": root / "train.jsonl", "eval": root / "eval.jsonl"}
    files["train"].write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks[:24]))
    files["eval"].write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks[24:32]))
    return files


def tiny_config(files: dict[str, Path], out: Path, *overrides: str) -> TrainConfig:
    """A few-step CPU config on ``tiny_files``; ``overrides`` are key=value strings."""
    base = [
        f"target={files['target']}", f"data.train={files['train']}", f"data.eval={files['eval']}",
        f"output_dir={out}", f"cache_dir={out.parent / 'cache'}", f"data.max_length={MAX_LENGTH}",
        "data.eval_rows=4", "train.micro_batch_size=4", "train.max_steps=12", "train.lr=3e-3",
        "train.warmup_steps=2", "train.log_every=3", "train.eval_every=6", "train.save_every=0",
        # decode tau on 2 prompts x 8 tokens: the path runs at every eval; its default 8 x 64 cost ~4 s a run
        "train.eval_decode_rows=2", "train.eval_decode_tokens=8",
    ]
    return load_config(None, base + list(overrides))
