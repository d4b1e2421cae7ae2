"""Token ids and loss masks from a tokenizer's own chat template (never hard-coded separators).

``loss_mask[i] == 1`` means token ``i`` is a training target (the trainer shifts labels itself).

Conversations — two methods, same contract:
- ``"generation"`` (template has ``{% generation %}`` markers): the assistant mask of
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``; the template decides the span.
- ``"prefix_diff"`` (any other template): render ``messages[:i]`` with the generation prompt and
  ``messages[:i+1]``; the assistant turn is the text the second adds to the first, i.e. what the
  model generates after the prompt: the content **and the end-of-turn token** (``<|im_end|>``,
  ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``), without the role header and without the whitespace
  the template writes after the end of turn (the model stops at the end-of-turn token; that
  newline is context for the next turn). Both renderings must be prefixes of the full rendering;
  a template that rewrites earlier turns (e.g. Mistral v0.3 moves the system prompt into the last
  user turn) fails this check and the row is rejected (``template_mismatch``) rather than
  mis-aligned. Spans are located in characters and mapped through one tokenization of the full
  text, so token merges across a prefix boundary cannot shift them; a token straddling a span edge
  is included (as ``return_assistant_tokens_mask`` does).
Both methods require every assistant turn to map to its own non-empty run of masked tokens.

Plain text: ``[BOS] + tokens(text)`` when the tokenizer has a BOS token (added here, never by the
tokenizer's post-processor, so it appears exactly once), no EOS (corpus chunks are arbitrary cuts,
not documents that end). BOS gets mask 0 (nothing predicts it), every text token gets 1. A row that
carries its ``token_ids`` (the target's own tokens: ``data.self_distill`` writes them) is trained on
those, not on the text tokenized again: text decoded from a model's tokens does not always tokenize back
to them (a run of n single newlines comes back as n/2 double newlines), and a head must learn the tokens
the target emits. They must be ids of this tokenizer that decode to the row's text.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, Literal

from jinja2 import TemplateError

from draftsmith.data.conversations import (BAD_TOKEN_IDS, MASK_MISMATCH, TEMPLATE_ERROR, TEMPLATE_MISMATCH,
                                          TURN_IDS_NOT_SPLICED, Messages, RowError)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Method = Literal["generation", "prefix_diff"]

# The pattern transformers uses to decide whether a template supports the assistant mask, applied
# after removing Jinja comments (a comment that mentions the tag does not make a span).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)


def chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's (default) chat template; ValueError if it has none."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: HF uses "default"
        template = template.get("default")
    if not template:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template; conversation rows need one "
            "(set tokenizer.chat_template)"
        )
    return template


def mask_method(tokenizer: PreTrainedTokenizerBase) -> Method:
    """``"generation"`` when the chat template marks assistant spans, else ``"prefix_diff"``."""
    template = _JINJA_COMMENT.sub("", chat_template(tokenizer))
    return "generation" if _GENERATION_TAG.search(template) else "prefix_diff"


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, method: Method | None = None,
    repairs: Counter | None = None,
) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a conversation; ``method=None`` picks it from the template. Assistant turns
    carrying ``token_ids`` are trained on them (``splice_turn_ids``; a turn that cannot be is counted in ``repairs``).

    Raises ``RowError`` (template_error / template_mismatch / mask_mismatch / bad_token_ids) for rows that cannot
    be masked reliably.
    """
    if not tokenizer.is_fast:
        raise TypeError(f"loss masks need a fast tokenizer (offsets); got {type(tokenizer).__name__}")
    own = [m.get("token_ids") for m in messages]
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    ids, mask = _encode_conversation(tokenizer, messages, method)
    if any(t is not None for t in own):
        ids, mask = splice_turn_ids(tokenizer, messages, own, ids, mask,
                                    repairs if repairs is not None else Counter())
    return ids, mask


def splice_turn_ids(tokenizer: PreTrainedTokenizerBase, messages: Messages, own: list, ids: list[int],
                    mask: list[int], repairs: Counter) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` with each assistant turn's content tokens replaced by the ids the target wrote (``own[i]``,
    checked as a text row's are: RowError ``bad_token_ids``), where the template renders the content verbatim right
    after the turn's generation prompt and the conversation's tokens have a boundary at both of its ends: the target
    generated those ids right after that prompt. A turn that cannot be spliced keeps its text's tokens and is
    counted in ``repairs`` (``assistant_turn_ids_not_spliced``; templates that trim the content, for one)."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    aligned = list(enc["input_ids"]) == ids  # the generation method's ids are the rendered text's
    offsets = enc["offset_mapping"]
    starts, ends = {}, {}  # a character position -> the first token starting there / past the last ending there
    for t, (start, end) in enumerate(offsets):
        starts.setdefault(start, t)
        ends[end] = t + 1
    cuts = []  # (first token, past-the-last token, the turn's ids), in order
    for i, (message, turn_ids) in enumerate(zip(messages, own)):
        if turn_ids is None:
            continue
        turn_ids = _checked_ids(tokenizer, message["content"], turn_ids, f"turn {i}'s content")
        begin = len(_render(tokenizer, messages[:i], add_generation_prompt=True))
        end = begin + len(message["content"])
        a, b = starts.get(begin), ends.get(end)
        if aligned and full[begin:end] == message["content"] and a is not None and b is not None and (
                a == 0 or offsets[a - 1][1] <= begin) and (b == len(offsets) or offsets[b][0] >= end):
            cuts.append((a, b, turn_ids))
        else:
            repairs[TURN_IDS_NOT_SPLICED] += 1
    out_ids, out_mask, at = [], [], 0
    for a, b, turn_ids in cuts:
        out_ids += ids[at:a] + turn_ids
        out_mask += mask[at:a] + [1] * len(turn_ids)
        at = b
    return out_ids + ids[at:], out_mask + mask[at:]


def _encode_conversation(tokenizer: PreTrainedTokenizerBase, messages: Messages,
                         method: Method | None) -> tuple[list[int], list[int]]:
    method = method or mask_method(tokenizer)
    if method == "generation":
        ids, mask = _generation_mask(tokenizer, messages)
    elif method == "prefix_diff":
        ids, mask = _prefix_diff_mask(tokenizer, messages)
    else:
        raise ValueError(f"unknown mask method {method!r}; expected 'generation' or 'prefix_diff'")
    n_turns = sum(m["role"] == "assistant" for m in messages)
    runs = mask_runs(mask)
    if len(runs) != n_turns:
        raise RowError(
            MASK_MISMATCH,
            f"{n_turns} assistant turns but {len(runs)} masked token runs ({method}); "
            "the template's generation spans do not cover each assistant turn",
        )
    # transformers masks to the end of the sequence when a span's last character maps to no token;
    # that would put loss on the turns after the last assistant one.
    if runs[-1][1] == len(mask) and messages[-1]["role"] != "assistant":
        trailing = messages[-1]["role"]
        raise RowError(MASK_MISMATCH, f"the last assistant span runs into the trailing {trailing} turn")
    return ids, mask


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str,
                token_ids: object = None) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of a plain-text row: optional BOS (mask 0), then text (mask 1), the text's
    tokens being ``token_ids`` when the row carries them (checked: RowError ``bad_token_ids``)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if token_ids is None else \
        _checked_ids(tokenizer, text, token_ids)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return bos + ids, [0] * len(bos) + [1] * len(ids)


def _checked_ids(tokenizer: PreTrainedTokenizerBase, text: str, token_ids: object,
                 where: str = "'text'") -> list[int]:
    """``token_ids`` as a list of ints, when they are ids of ``tokenizer`` that decode to ``text`` (``where``)."""
    size = len(tokenizer)
    if not isinstance(token_ids, (list, tuple)) or not token_ids or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise RowError(BAD_TOKEN_IDS, f"'token_ids' is not a non-empty list of ints: {str(token_ids)[:60]}")
    if not all(0 <= t < size for t in token_ids):
        bad = next(t for t in token_ids if not 0 <= t < size)
        raise RowError(BAD_TOKEN_IDS, f"'token_ids' holds {bad}, outside this tokenizer's {size} ids")
    decoded = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    if decoded != text:
        at = next((i for i, (a, b) in enumerate(zip(decoded, text)) if a != b), min(len(decoded), len(text)))
        raise RowError(BAD_TOKEN_IDS, f"'token_ids' decode to a text other than {where} (from character {at}: "
                                      f"{decoded[at:at + 20]!r} against {text[at:at + 20]!r}; another tokenizer?)")
    return list(token_ids)


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """Maximal ``[start, end)`` ranges where ``mask`` is 1."""
    runs, start = [], None
    for i, bit in enumerate(mask):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def _render(tokenizer: PreTrainedTokenizerBase, messages: Messages, add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as err:
        raise RowError(TEMPLATE_ERROR, str(err)) from err


def _generation_mask(
    tokenizer: PreTrainedTokenizerBase, messages: Messages
) -> tuple[list[int], list[int]]:
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except TemplateError as err:
        raise RowError(TEMPLATE_ERROR, str(err)) from err
    return list(out["input_ids"]), list(out["assistant_masks"])


def _prefix_diff_mask(
    tokenizer: PreTrainedTokenizerBase, messages: Messages
) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = []  # [start, end) character ranges of assistant turns in `full`
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise RowError(
                TEMPLATE_MISMATCH, "the first message is an assistant turn: no prompt to diff against"
            )
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        turn = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False)
        if not (turn.startswith(prompt) and full.startswith(turn)):
            raise RowError(
                TEMPLATE_MISMATCH,
                f"rendering messages[:{i}] (+ generation prompt) or messages[:{i + 1}] is not a prefix "
                "of the full conversation: the template rewrites earlier turns; add {% generation %} "
                "markers to the template to mask it",
            )
        # Whitespace after the end-of-turn token is template layout before the next turn.
        spans.append((len(prompt), len(turn.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(enc["input_ids"])
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        if any(start < span_end and end > span_start for span_start, span_end in spans):
            mask[t] = 1
    return list(enc["input_ids"]), mask
