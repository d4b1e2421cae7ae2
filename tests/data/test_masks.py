"""Loss masks from fixture chat templates: 1 exactly on assistant turns (content + end of turn)."""
from __future__ import annotations

import pytest
from fixtures.chat_tokenizers import STYLES, make_chat_tokenizer

from collections import Counter

from draftsmith.data.conversations import (BAD_TOKEN_IDS, MASK_MISMATCH, TEMPLATE_ERROR, TEMPLATE_MISMATCH,
                                          TURN_IDS_NOT_SPLICED, RowError)
from draftsmith.data.masks import encode_conversation, encode_text, mask_method, mask_runs

WITH_SYSTEM = [
    {"role": "system", "content": "You are terse. Answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy? Say it twice."},
    {"role": "assistant", "content": "  Rome.\nRome. "},  # whitespace that trimming templates drop
    {"role": "user", "content": "Repeat my first question."},
    # Same text as a user turn: locating assistant text by searching the render would mis-align.
    {"role": "assistant", "content": "What is the capital of France?"},
]
NO_SYSTEM = [
    {"role": "user", "content": "Write add(a, b) in Python."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    {"role": "user", "content": "Thanks!"},  # trailing user turn: rendered, never masked
]
FOUR_STYLES = ("chatml", "chatml_generation", "llama3", "mistral", "gemma", "alpaca")


def masked_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    return [tokenizer.decode(ids[a:b], skip_special_tokens=False) for a, b in mask_runs(mask)]


@pytest.mark.parametrize("style", FOUR_STYLES)
@pytest.mark.parametrize("messages", [WITH_SYSTEM, NO_SYSTEM], ids=["system", "no_system"])
def test_mask_is_exactly_the_assistant_turns(style, messages):
    tokenizer = make_chat_tokenizer(style)
    ids, mask = encode_conversation(tokenizer, messages)

    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    # The ids are the template's own tokenization of the whole conversation.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    expected = [STYLES[style].assistant_span(m["content"]) for m in messages if m["role"] == "assistant"]
    # One run per assistant turn, each decoding to exactly that turn: headers, user and system
    # turns and the newline after an end-of-turn token are all outside the mask.
    assert masked_spans(tokenizer, ids, mask) == expected


def test_method_follows_the_template():
    assert mask_method(make_chat_tokenizer("chatml_generation")) == "generation"
    for style in ("chatml", "llama3", "mistral", "gemma", "alpaca"):
        assert mask_method(make_chat_tokenizer(style)) == "prefix_diff"


@pytest.mark.parametrize("messages", [WITH_SYSTEM, NO_SYSTEM], ids=["system", "no_system"])
def test_generation_and_prefix_diff_agree_on_chatml(messages):
    marked = make_chat_tokenizer("chatml_generation")
    from_markers = encode_conversation(marked, messages, "generation")
    assert encode_conversation(marked, messages, "prefix_diff") == from_markers
    # The unmarked ChatML template renders the same text, so it must give the same example.
    assert encode_conversation(make_chat_tokenizer("chatml"), messages) == from_markers


def test_template_rewriting_earlier_turns_is_refused_not_misaligned():
    tokenizer = make_chat_tokenizer("mistral_v03")  # system prompt goes into the *last* user turn
    with pytest.raises(RowError) as info:
        encode_conversation(tokenizer, WITH_SYSTEM)
    assert info.value.reason == TEMPLATE_MISMATCH
    assert "generation" in str(info.value)  # tells the user how to fix the template
    # Without a system prompt the template is prefix-stable and masks normally.
    ids, mask = encode_conversation(tokenizer, NO_SYSTEM[:2])
    assert masked_spans(tokenizer, ids, mask) == [" " + NO_SYSTEM[1]["content"] + "</s>"]


def test_template_exception_is_a_row_error():
    tokenizer = make_chat_tokenizer("mistral")
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    for method in ("prefix_diff", "generation"):
        with pytest.raises(RowError) as info:
            encode_conversation(tokenizer, messages, method)
        assert info.value.reason == TEMPLATE_ERROR and "alternate" in info.value.detail


def test_generation_markers_missing_a_turn_is_a_mask_mismatch():
    # Marks only the final assistant turn: earlier turns would silently get no loss.
    template = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
        "{%- if m['role'] == 'assistant' and loop.last %}"
        "{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{%- else %}{{- m['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
    )
    tokenizer = make_chat_tokenizer(template)
    encode_conversation(tokenizer, NO_SYSTEM[:2])  # one assistant turn: fine
    with pytest.raises(RowError) as info:
        encode_conversation(tokenizer, WITH_SYSTEM)
    assert info.value.reason == MASK_MISMATCH


def test_first_message_from_assistant():
    messages = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"}]
    with pytest.raises(RowError) as info:
        encode_conversation(make_chat_tokenizer("chatml"), messages)
    assert info.value.reason == TEMPLATE_MISMATCH
    tokenizer = make_chat_tokenizer("chatml_generation")  # the markers need no prefix
    ids, mask = encode_conversation(tokenizer, messages)
    assert masked_spans(tokenizer, ids, mask) == ["Hello!<|im_end|>"]


def test_missing_chat_template_fails_loudly():
    with pytest.raises(ValueError, match="no chat template"):
        encode_conversation(make_chat_tokenizer(None), NO_SYSTEM)


def test_plain_text_gets_one_bos_and_full_loss():
    text = "def add(a, b):\n    return a + b\n"
    tokenizer = make_chat_tokenizer(None, bos="<s>")
    ids, mask = encode_text(tokenizer, text)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert mask == [0] + [1] * (len(ids) - 1)
    assert tokenizer.decode(ids[1:]) == text

    no_bos = make_chat_tokenizer(None, bos=None)
    ids, mask = encode_text(no_bos, text)
    assert mask == [1] * len(ids) and no_bos.decode(ids) == text


def test_a_text_row_trains_on_the_token_ids_it_carries():
    tokenizer = make_chat_tokenizer(None, bos="<s>")
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    assert len(space) == 1 and tokenizer("  ", add_special_tokens=False)["input_ids"] != space * 2  # merged again
    own = tokenizer("a", add_special_tokens=False)["input_ids"] + space * 2 + tokenizer("b", add_special_tokens=False)[
        "input_ids"]  # as a model may write "a  b": the text tokenizes to other ids
    ids, mask = encode_text(tokenizer, "a  b", own)
    assert ids[1:] == own != encode_text(tokenizer, "a  b")[0][1:]
    assert ids[0] == tokenizer.bos_token_id and mask == [0] + [1] * (len(ids) - 1)


@pytest.mark.parametrize("token_ids, message", [
    ([], "not a non-empty list of ints"), ("abc", "not a non-empty list of ints"),
    ([1.5], "not a non-empty list of ints"), ([True], "not a non-empty list of ints"),
    ([5, 400], "holds 400, outside this tokenizer's 400 ids"), ([-1], "holds -1"),
    ("other", "decode to a text other than 'text' \\(from character 0: 'x  b' against 'a  b'"),
])
def test_token_ids_that_are_not_this_texts_are_refused_naming_why(token_ids, message):
    tokenizer = make_chat_tokenizer(None, bos="<s>")
    if token_ids == "other":
        token_ids = tokenizer("x  b", add_special_tokens=False)["input_ids"]
    with pytest.raises(RowError, match=message) as err:
        encode_text(tokenizer, "a  b", token_ids)
    assert err.value.reason == BAD_TOKEN_IDS


def _two_spaces(tokenizer, left: str, right: str) -> list[int]:
    """``left + "  " + right`` as a model may write it: the two spaces as two tokens (the text tokenizes otherwise)."""
    piece = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    own = piece(left) + piece(" ") * 2 + piece(right)
    assert piece(f"{left}  {right}") != own
    return own


@pytest.mark.parametrize("style", ["chatml", "chatml_generation"])
def test_an_assistant_turn_trains_on_the_token_ids_it_carries(style):
    """Where the template renders the content verbatim after the generation prompt, the turn's tokens are the
    ids it carries (the other tokens and the masked text unchanged); plant: the ids not spliced."""
    tokenizer = make_chat_tokenizer(style)
    own = _two_spaces(tokenizer, "a", "b")
    plain = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "a  b"},
             {"role": "user", "content": "More."}, {"role": "assistant", "content": "Done."}]
    carried = [dict(m) for m in plain]
    carried[1]["token_ids"] = own
    repairs = Counter()
    ids, mask = encode_conversation(tokenizer, carried, repairs=repairs)
    base_ids, base_mask = encode_conversation(tokenizer, plain)
    at = next(i for i in range(len(ids)) if ids[i:i + len(own)] == own)
    assert ids[:at] == base_ids[:at] and mask[:at] == base_mask[:at] and mask[at:at + len(own)] == [1] * len(own)
    assert ids != base_ids and tokenizer.decode(ids) == tokenizer.decode(base_ids)
    assert masked_spans(tokenizer, ids, mask) == masked_spans(tokenizer, base_ids, base_mask)
    assert not repairs


def test_a_turn_the_template_does_not_render_verbatim_keeps_its_texts_tokens():
    """llama3's template trims the content: the ids cannot be spliced; the turn is counted, nothing is lost."""
    tokenizer = make_chat_tokenizer("llama3")
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "a  b "}]
    repairs = Counter()
    carried = [messages[0], {**messages[1], "token_ids": _two_spaces(tokenizer, "a", "b ")}]
    assert encode_conversation(tokenizer, carried, repairs=repairs) == encode_conversation(tokenizer, messages)
    assert repairs == {TURN_IDS_NOT_SPLICED: 1}
    carried[1]["token_ids"] = [5, 400]
    with pytest.raises(RowError, match="bad_token_ids: 'token_ids' holds 400"):
        encode_conversation(tokenizer, carried)


def test_demo_tokenizer_template_masks_like_prefix_diff():
    from draftsmith.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer([m["content"] for m in WITH_SYSTEM + NO_SYSTEM] * 4, vocab_size=300)
    assert mask_method(tokenizer) == "generation"
    for messages in (WITH_SYSTEM, NO_SYSTEM):
        ids, mask = encode_conversation(tokenizer, messages)
        assert encode_conversation(tokenizer, messages, "prefix_diff") == (ids, mask)
        expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert masked_spans(tokenizer, ids, mask) == expected


def test_generation_span_running_past_its_turn_is_refused(monkeypatch):
    # Whitespace maps to no token here, so transformers extends a span ending in a space to the
    # end of the sequence, over the trailing user turn.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "yo": 2, "bye": 3}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
        "{%- generation %}{{- m['content'] + ' ' }}{%- endgeneration %}"
        "{%- else %}{{- m['content'] + ' ' }}{%- endif %}{%- endfor %}"
    )
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert encode_conversation(tokenizer, turns) == ([1, 2], [0, 1])
    trailing = turns + [{"role": "user", "content": "bye"}]
    # transformers < 5.24 extends the span over the trailing turn (refused); 5.24 masks it right.
    # Either way no loss lands on the user's "bye".
    try:
        assert encode_conversation(tokenizer, trailing) == ([1, 2, 3], [0, 1, 0])
    except RowError as err:
        assert err.reason == MASK_MISMATCH and "trailing user turn" in err.detail
    # the guard itself, on the mask the older transformers returns
    import draftsmith.data.masks
    from draftsmith import data

    monkeypatch.setattr(data.masks, "_generation_mask", lambda tok, messages: ([1, 2, 3], [0, 1, 1]))
    with pytest.raises(RowError) as info:
        encode_conversation(tokenizer, trailing)
    assert info.value.reason == MASK_MISMATCH and "trailing user turn" in info.value.detail
