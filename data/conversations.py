"""Raw rows → validated OpenAI-style messages or plain text, with a named reason for every reject.

Accepted row shapes (checked in this order, so a row carrying several uses the first):
- ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI),
- ``{"conversations": [{"from": ..., "value": ...}, ...]}`` (ShareGPT; roles mapped below),
- ``{"text": ...}`` (plain text, trained on every token).
Keys holding ``None`` count as absent: Parquet files and ``datasets`` tables give every row every
column, so a text row in a mixed table carries ``messages=None``. Message keys other than the role
and the content (``name``, ``tool_calls``, ...) are dropped.
"""
from __future__ import annotations

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
)

ROLES = frozenset({"system", "user", "assistant"})
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}

Messages = list[dict[str, str]]


class RowError(ValueError):
    """A row that cannot become a training example; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def normalize_row(row: object) -> Messages | str:
    """The row's messages as ``[{"role", "content"}]``, or its text for a plain-text row.

    Raises ``RowError`` with the reason the row is unusable.
    """
    if not isinstance(row, Mapping):
        raise RowError(BAD_STRUCTURE, f"row is a {type(row).__name__}, not a dict")
    if row.get("messages") is not None:
        return _normalize_turns(row["messages"], "messages", "role", "content", role_map=None)
    if row.get("conversations") is not None:
        return _normalize_turns(
            row["conversations"], "conversations", "from", "value", role_map=SHAREGPT_ROLES
        )
    if row.get("text") is not None:
        text = row["text"]
        _check_content(text, "'text'")
        return text
    raise RowError(
        MISSING_FIELD, f"row has none of 'messages', 'conversations', 'text' (keys: {sorted(row)})"
    )


def _normalize_turns(
    turns: object, field: str, role_key: str, content_key: str, role_map: dict[str, str] | None
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
        messages.append({"role": role, "content": turn[content_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(NO_ASSISTANT_TURN, f"'{field}' has no assistant turn")
    return messages


def _check_content(content: object, where: str) -> None:
    if not isinstance(content, str):
        raise RowError(NON_STRING_CONTENT, f"{where} is a {type(content).__name__}, not a string")
    if not content.strip():
        raise RowError(EMPTY_CONTENT, f"{where} is empty")
