"""Shared pieces of the training tests (no tests here): a tiny target with its own tokenizer,
text data as .jsonl, and a config builder. Import the fixture into a test module to use it. And ``TreeOracle``, the
generator tests' drafter that knows each row's reference continuation."""
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
from draftsmith.infer.drafters import Draft, Drafter, Sampling
from draftsmith.infer.tree import tree_from_parents
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


class TreeOracle(Drafter):
    """Drafts a tree around each row's reference continuation: the true token at each depth (sometimes
    replaced by a wrong one), shuffled among decoy siblings that carry decoy subtrees. ``references`` maps a
    prompt's tokens to its reference: (prompt + greedy continuation (L,), the true final hidden states
    along it (L, H)), which every forward the generator reports is checked against. (``infer.bench.oracle``'s
    ``OracleDrafter`` is the benchmarks': a chain or fixed tree, no checks.)"""

    aux_layer_ids = ()

    def __init__(self, references: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]], depth: int,
                 seed: int, wrong_rate: float, vocab: int = 96):
        self.references, self.depth, self.rng, self.wrong_rate = references, depth, random.Random(seed), wrong_rate
        self.vocab = vocab

    def new_rows(self, prompts: list[torch.Tensor], lengths: list[int]) -> list[dict]:
        return [dict(zip(("seq", "features"), self.references[tuple(p[0].tolist())]), pos=0) for p in prompts]

    def observe_rows(self, states: list[dict], features: list[torch.Tensor], next_tokens: list[torch.Tensor]) -> None:
        for state, feats, tokens in zip(states, features, next_tokens):
            self._observe(state, feats, tokens)

    def propose_rows(self, states: list[dict], roots: list[torch.Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        return [self._propose(s, r, d) for s, r, d in zip(states, roots, max_depths)]

    def _observe(self, state: dict, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        start, count = state["pos"], next_tokens.shape[1]
        assert torch.equal(next_tokens[0], state["seq"][start + 1 : start + 1 + count])
        tol = 1e-8 if features.dtype == torch.float64 else 1e-4
        torch.testing.assert_close(features[0], state["features"][start : start + count], rtol=tol, atol=tol)
        state["pos"] += count

    def _propose(self, state: dict, root: torch.Tensor, max_depth: int) -> Draft:
        seq, pos = state["seq"], state["pos"]
        assert int(root) == int(seq[pos])
        levels = min(self.depth, max_depth, seq.numel() - pos - 1)
        parents, tokens = [-1], [int(root)]
        main, decoys = 0, []  # node on the true path; decoy nodes of the previous level
        for d in range(1, levels + 1):
            truth = int(seq[pos + d])
            token = (truth + 1) % self.vocab if self.rng.random() < self.wrong_rate else truth
            level = [(main, token, True)]
            level += [(main, (truth + k) % self.vocab, False) for k in range(2, 2 + self.rng.randrange(3))]
            self.rng.shuffle(level)
            level += [(p, self.rng.randrange(self.vocab), False) for p in decoys]
            decoys = []
            for parent, tok, on_path in level:
                parents.append(parent)
                tokens.append(tok)
                if on_path:
                    main = len(tokens) - 1
                else:
                    decoys.append(len(tokens) - 1)
        return Draft(torch.tensor(tokens), tree_from_parents(parents))
