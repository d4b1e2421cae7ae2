"""Raw rows → validated OpenAI-style messages or plain text, with a named reason for every reject.

Accepted row shapes (checked in this order, so a row carrying several uses the first):
- ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI),
- ``{"conversations": [{"from": ..., "value": ...}, ...]}`` (ShareGPT; roles mapped below),
- ``{"text": ...}`` (plain text, trained on every token).
Keys holding ``None`` count as absent: Parquet files and ``datasets`` tables give every row every
column, so a text row in a mixed table carries ``messages=None``. Message keys other than the role
and the content (``name``, ``tool_calls``, ...) are dropped, but for an OpenAI assistant turn's ``token_ids``
(the ids the target wrote, which ``scripts/regenerate.py`` keeps).

ShareGPT rows are repaired the way published dumps need (ShareGPT V3 as crawled: many
conversations start with a ``gpt`` turn, the answer to a prompt that was not kept; some repeat a
role): role aliases are mapped (``SHAREGPT_ROLES``), leading assistant turns are dropped and
consecutive turns of one role are joined with a blank line. Each repair is counted per turn under
one of ``REPAIRS``. OpenAI ``messages`` rows are taken as written.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

# Skip reasons. A rejected row is counted under exactly one of them (or raises in strict mode).
MISSING_FIELD = "missing_field"  # none of messages / conversations / text
BAD_STRUCTURE = "bad_structure"  # not a dict, or turns not a list of dicts with the role/content keys
UNKNOWN_ROLE = "unknown_role"
NON_STRING_CONTENT = "non_string_content"
EMPTY_CONTENT = "empty_content"  # empty or whitespace-only content or text
NO_ASSISTANT_TURN = "no_assistant_turn"
TEMPLATE_ERROR = "template_error"  # the chat template raised (e.g. "roles must alternate")
TEMPLATE_MISMATCH = "template_mismatch"  # template rewrites earlier turns: prefixes cannot be diffed
MASK_MISMATCH = "mask_mismatch"  # assistant spans do not map one-to-one onto token runs
OVERLONG = "overlong"  # longer than max_length under overlong="drop"
NO_LOSS_AFTER_TRUNCATION = "no_loss_after_truncation"  # truncation removed every assistant token
BAD_TOKEN_IDS = "bad_token_ids"  # a row's or turn's token_ids are not ids of this tokenizer that decode to its text

REASONS = (
    MISSING_FIELD,
    BAD_STRUCTURE,
    UNKNOWN_ROLE,
    NON_STRING_CONTENT,
    EMPTY_CONTENT,
    NO_ASSISTANT_TURN,
    TEMPLATE_ERROR,
    TEMPLATE_MISMATCH,
    MASK_MISMATCH,
    OVERLONG,
    NO_LOSS_AFTER_TRUNCATION,
    BAD_TOKEN_IDS,
)

ROLES = frozenset({"system", "user", "assistant"})
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
SHAREGPT_CANONICAL = frozenset({"system", "human", "gpt"})  # the dump's own names: no repair to count

# ShareGPT repairs, each counted per turn.
ROLE_ALIAS = "role_alias_turns"  # a role other than human/gpt/system mapped (chatgpt, bing, bard, user)
LEADING_ASSISTANT = "leading_assistant_turns_dropped"  # assistant turns before the first user turn
MERGED_SAME_ROLE = "same_role_turns_merged"  # a turn joined onto the previous turn of the same role
# an assistant turn with the target's token_ids that the template does not render verbatim after its generation
# prompt, on token boundaries: trained on its text's tokens (data.masks.splice_turn_ids)
TURN_IDS_NOT_SPLICED = "assistant_turn_ids_not_spliced"
REPAIRS = (ROLE_ALIAS, LEADING_ASSISTANT, MERGED_SAME_ROLE, TURN_IDS_NOT_SPLICED)

Messages = list[dict[str, str]]


class RowError(ValueError):
    """A row that cannot become a training example; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def normalize_row(row: object, repairs: Counter | None = None) -> Messages | str:
    """The row's messages as ``[{"role", "content"}]``, or its text for a plain-text row.

    ShareGPT repairs are added to ``repairs`` (keys from ``REPAIRS``). Raises ``RowError`` with the
    reason the row is unusable.
    """
    if not isinstance(row, Mapping):
        raise RowError(BAD_STRUCTURE, f"row is a {type(row).__name__}, not a dict")
    if row.get("messages") is not None:
        return _normalize_turns(row["messages"], "messages", "role", "content", role_map=None)
    if row.get("conversations") is not None:
        return _normalize_turns(
            row["conversations"], "conversations", "from", "value", role_map=SHAREGPT_ROLES,
            repairs=repairs if repairs is not None else Counter(),
        )
    if row.get("text") is not None:
        text = row["text"]
        _check_content(text, "'text'")
        return text
    raise RowError(
        MISSING_FIELD, f"row has none of 'messages', 'conversations', 'text' (keys: {sorted(row)})"
    )


def _normalize_turns(
    turns: object, field: str, role_key: str, content_key: str, role_map: dict[str, str] | None,
    repairs: Counter | None = None,
) -> Messages:
    if not isinstance(turns, (list, tuple)) or not turns:
        raise RowError(BAD_STRUCTURE, f"'{field}' must be a non-empty list, got {turns!r:.80}")
    messages = []
    for i, turn in enumerate(turns):
        where = f"'{field}'[{i}]"
        if not isinstance(turn, Mapping) or role_key not in turn or content_key not in turn:
            raise RowError(BAD_STRUCTURE, f"{where} must be a dict with '{role_key}' and '{content_key}'")
        raw_role = turn[role_key]
        if role_map is None:
            role = raw_role if raw_role in ROLES else None
        else:
            # ShareGPT dumps disagree on case ("human" / "Human"); OpenAI roles are exact.
            role = role_map.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise RowError(UNKNOWN_ROLE, f"{where} has role {raw_role!r}")
        _check_content(turn[content_key], f"{where}.{content_key}")
        if repairs is not None and raw_role.lower() not in SHAREGPT_CANONICAL:
            repairs[ROLE_ALIAS] += 1
        message = {"role": role, "content": turn[content_key]}
        if role_map is None and role == "assistant" and turn.get("token_ids") is not None:
            message["token_ids"] = turn["token_ids"]  # the ids the target wrote (data.masks.splice_turn_ids)
        messages.append(message)
    if repairs is not None:
        messages = _repair(messages, repairs)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(NO_ASSISTANT_TURN, f"'{field}' has no assistant turn")
    return messages


def _repair(messages: Messages, repairs: Counter) -> Messages:
    """Drop assistant turns before the first user turn (system turns stay), then join runs of
    one role: chat templates and the prefix-diff mask need an assistant turn to follow a prompt."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    leading = [i for i, m in enumerate(messages[:first_user]) if m["role"] == "assistant"]
    if leading:
        repairs[LEADING_ASSISTANT] += len(leading)
        drop = set(leading)
        messages = [m for i, m in enumerate(messages) if i not in drop]
    merged: Messages = []
    for m in messages:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
            repairs[MERGED_SAME_ROLE] += 1
        else:
            merged.append(dict(m))
    return merged


def _check_content(content: object, where: str) -> None:
    if not isinstance(content, str):
        raise RowError(NON_STRING_CONTENT, f"{where} is a {type(content).__name__}, not a string")
    if not content.strip():
        raise RowError(EMPTY_CONTENT, f"{where} is empty")
