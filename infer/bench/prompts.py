"""Benchmark prompts as token ids."""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path


def load_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Token-id prompts: a JSONL file of {"prompt": str} or {"messages": [...]}, else the demo
    corpus's held-out split (code continuation: the first ``--prompt-tokens`` tokens of a file chunk)."""
    prompts: list[list[int]] = []
    if args.prompts == "demo:mtbench":  # MT-bench first turns, categories interleaved (data.assets)
        from draftsmith.data.assets import mtbench_prompts

        for messages in mtbench_prompts():
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            prompts.append(list(ids["input_ids"]))
    elif args.prompts:
        for line_no, line in enumerate(Path(args.prompts).read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = _row(args.prompts, line_no, line)
            if "messages" in row:
                ids = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, Mapping) else ids  # a BatchEncoding is no dict
            elif "prompt" in row:
                ids = tokenizer(row["prompt"])["input_ids"]
            else:
                raise ValueError(f"{args.prompts}:{line_no}: a prompt row needs 'prompt' or 'messages', got {sorted(row)}")
            prompts.append(list(ids))
    else:
        from draftsmith.data.corpus import continuation_prompts

        prompts = continuation_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.max_new_tokens)
    if not prompts:
        raise ValueError("no prompts: the prompt file is empty or no held-out chunk is long enough")
    return prompts[: args.num_prompts]


def _row(path: str, line_no: int, line: str) -> dict:
    """Line ``line_no`` of the prompts file as a JSON object; a cut or broken line is named by its own number
    (``json.loads`` of one line reports "line 1" whatever line it is)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{line_no}: invalid JSON at column {err.colno}: {err.msg} (a file cut mid-line?)") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line_no}: a prompt row is a JSON object with 'prompt' or 'messages', got "
                         f"{type(row).__name__}")
    return row
