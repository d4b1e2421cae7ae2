"""ShareGPT as published: role aliases, leading assistant turns, same-role runs, truncated JSON."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from fixtures.chat_tokenizers import make_chat_tokenizer

from draftsmith.data import assets
from draftsmith.data.conversations import LEADING_ASSISTANT, MERGED_SAME_ROLE, ROLE_ALIAS, RowError, normalize_row
from draftsmith.data.masks import mask_runs
from draftsmith.data.jsonfile import read_json
from draftsmith.data.pipeline import build_examples, load_rows


def turns(*pairs: tuple[str, str], id: str = "x_0") -> dict:
    return {"id": id, "conversations": [{"from": f, "value": v} for f, v in pairs]}


# One row per transformation, and one that needs none.
ROWS = [
    turns(("human", "Capital of France?"), ("gpt", "Paris.")),
    turns(("gpt", "(answer to a prompt that was not kept)"), ("human", "Capital of Italy?"), ("gpt", "Rome.")),
    turns(("human", "Two"), ("human", "questions?"), ("gpt", "One"), ("gpt", "answer.")),
    turns(("system", "Be terse."), ("user", "Hi?"), ("chatgpt", "Hi."), ("human", "Bye?"), ("bing", "Bye."),
          ("human", "Again?"), ("bard", "No.")),
]


def test_each_repair_is_applied_and_counted():
    counts = Counter()
    out = [normalize_row(row, counts) for row in ROWS]
    assert out[0] == [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    assert out[1] == [{"role": "user", "content": "Capital of Italy?"}, {"role": "assistant", "content": "Rome."}]
    assert out[2] == [{"role": "user", "content": "Two\n\nquestions?"}, {"role": "assistant", "content": "One\n\nanswer."}]
    assert [m["role"] for m in out[3]] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert counts == {LEADING_ASSISTANT: 1, MERGED_SAME_ROLE: 2, ROLE_ALIAS: 4}


def test_leading_assistant_turns_go_but_a_leading_system_turn_stays():
    row = turns(("system", "Sys."), ("gpt", "a"), ("gpt", "b"), ("human", "q"), ("gpt", "c"))
    counts = Counter()
    assert [m["content"] for m in normalize_row(row, counts)] == ["Sys.", "q", "c"]
    assert counts == {LEADING_ASSISTANT: 2}


def test_a_row_of_assistant_turns_only_is_skipped_with_a_reason():
    with pytest.raises(RowError, match="no_assistant_turn"):
        normalize_row(turns(("gpt", "a"), ("gpt", "b")), Counter())


def test_openai_rows_are_taken_as_written():
    row = {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "c"}]}
    counts = Counter()
    assert len(normalize_row(row, counts)) == 3 and not counts


def test_pipeline_keeps_repaired_rows_and_counts_only_kept_ones(tmp_path):
    # ChatML with a default system prompt and no {% generation %}: the prefix-diff mask, as SmolLM2.
    tokenizer = make_chat_tokenizer("chatml")
    rows = ROWS + [turns(("gpt", "only an answer"))]
    examples, summary = build_examples(rows, tokenizer, max_length=512, cache_dir=tmp_path)
    assert (summary.rows_in, summary.examples_out, summary.skipped) == (5, 4, {"no_assistant_turn": 1})
    assert summary.normalized == {LEADING_ASSISTANT: 1, MERGED_SAME_ROLE: 2, ROLE_ALIAS: 4}  # not the skipped row's
    assert "normalized leading_assistant_turns_dropped: 1" in str(summary)
    ex = examples[1]  # the row whose leading gpt turn was dropped: loss on "Rome.<|im_end|>" only
    (start, end), = mask_runs(ex["loss_mask"])
    assert tokenizer.decode(ex["input_ids"][start:end]) == "Rome.<|im_end|>"
    assert "answer to a prompt" not in tokenizer.decode(ex["input_ids"])
    assert len(mask_runs(examples[3]["loss_mask"])) == 3


# ------------------------------------------------------------------ truncated JSON

FULL = [turns(("human", f"question {i} é"), ("gpt", f"answer {i} ✓"), id=f"r{i}_0") for i in range(3)]


def write_truncated(path, rows, cut_in_last: int):
    """A JSON array of ``rows`` cut ``cut_in_last`` bytes into the serialised last row."""
    text = json.dumps(rows, indent=2, ensure_ascii=False).encode()
    last_start = text.rindex(b'  {\n    "id"')
    path.write_bytes(text[: last_start + cut_in_last])
    complete_end = text.rindex(b"}", 0, last_start) + 1  # end of the row before the cut one
    return len(text[: last_start + cut_in_last]) - complete_end


@pytest.mark.parametrize("cut", [1, 25, 60, 61, 62, 63])  # into a key, a value, and inside é / ✓
def test_lenient_json_reads_complete_rows_and_reports_ignored_bytes(tmp_path, cut):
    path = tmp_path / "sharegpt.json"
    ignored = write_truncated(path, FULL, cut)
    rows, n = read_json(path, lenient=True)
    assert rows == FULL[:2] and n == ignored


def test_truncated_json_fails_by_default_naming_file_and_offset(tmp_path):
    path = tmp_path / "sharegpt.json"
    write_truncated(path, FULL, 40)
    size = path.stat().st_size
    with pytest.raises(ValueError, match=rf"{path}: invalid JSON at byte offset \d+ of {size} .*"
                                         r"data.lenient_json=true reads its complete rows"):
        load_rows(path)


def test_lenient_json_still_refuses_a_broken_row_that_is_not_the_cut_one(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"text": "a"}, {"text": "b",, }, {"text": "c"}, {"te')
    with pytest.raises(ValueError, match=r"invalid JSON at byte offset 29 inside the array \(row 1\)"):
        load_rows(path, lenient_json=True)


def test_lenient_jsonl_drops_only_a_cut_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c')
    assert load_rows(path, lenient_json=True) == [{"text": "a"}, {"text": "b"}]
    with pytest.raises(ValueError, match=r"rows.jsonl:3: invalid JSON"):
        load_rows(path)
    path.write_text('{"text": "a"}\n{"text": "b\n{"text": "c"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: invalid JSON"):
        load_rows(path, lenient_json=True)


def test_summary_reports_bytes_ignored_and_the_setting_keys_the_cache(tmp_path):
    path = tmp_path / "sharegpt.json"
    ignored = write_truncated(path, FULL, 30)
    tokenizer = make_chat_tokenizer("chatml")
    _, summary = build_examples(path, tokenizer, max_length=256, lenient_json=True, cache_dir=tmp_path / "c")
    assert (summary.examples_out, summary.bytes_ignored) == (2, ignored)
    assert f"ignored the last {ignored} bytes" in str(summary)
    with pytest.raises(ValueError, match="data.lenient_json=true"):  # not answered from the lenient cache entry
        build_examples(path, tokenizer, max_length=256, cache_dir=tmp_path / "c")


# ------------------------------------------------------------------ demo:sharegpt split


def test_demo_sharegpt_splits_by_conversation_id(tmp_path, monkeypatch):
    rows = [turns(("human", "q"), ("gpt", "a"), id=f"c{i}_{part}") for i in range(300) for part in range(2)]
    path = tmp_path / "sharegpt.json"
    ignored = write_truncated(path, rows + [turns(("human", "cut"), ("gpt", "off"), id="z_0")], 20)
    monkeypatch.setattr(assets, "fetch", lambda name: path)
    train, n_train = assets.demo_rows("demo:sharegpt")
    heldout, n_heldout = assets.demo_rows("demo:sharegpt:heldout")
    assert n_train == n_heldout == ignored
    assert len(train) + len(heldout) == 600 and 0 < len(heldout) < 30  # about 2% of conversations
    ids = lambda rs: {r["id"].rsplit("_", 1)[0] for r in rs}  # noqa: E731
    assert not ids(train) & ids(heldout)  # both parts of a conversation on the same side
    assert assets.demo_rows("demo:sharegpt:train")[0] == train
    assert assets.demo_fingerprint("demo:sharegpt") != assets.demo_fingerprint("demo:sharegpt:heldout")


def test_unknown_demo_data_names_the_known_ones():
    with pytest.raises(ValueError, match="demo:sharegpt \\(= demo:sharegpt:train\\), demo:sharegpt:heldout"):
        load_rows("demo:sharegpt:test")
