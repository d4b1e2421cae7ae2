"""rows → examples: input formats, bad-row accounting, over-length policy, keyed cache."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
from fixtures.chat_tokenizers import make_chat_tokenizer

from draftsmith.data.masks import encode_conversation, mask_runs
from draftsmith.data.pipeline import build_examples, default_cache_dir, load_rows

SYSTEM = {"role": "system", "content": "You are terse."}


def chat(*contents: str) -> dict:
    """An OpenAI-style row alternating user / assistant turns."""
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]}


ROWS = [
    {"messages": [SYSTEM] + chat("Capital of France?", "Paris.")["messages"]},
    {
        "conversations": [
            {"from": "human", "value": "Capital of Italy?"},
            {"from": "gpt", "value": "Rome."},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "Yes, Rome."},
        ]
    },
    {"text": "def add(a, b):\n    return a + b\n"},
    chat("Say hi.", "hi"),
]


@pytest.fixture
def chatml():
    return make_chat_tokenizer("chatml_generation")


def build(source, tokenizer, tmp_path, **kwargs):
    kwargs.setdefault("max_length", 512)
    return build_examples(source, tokenizer, cache_dir=tmp_path / "cache", **kwargs)


def write_sources(rows: list[dict], folder) -> dict[str, object]:
    """The same rows in every supported input form."""
    # A table gives every row every column, absent ones as None (from_list would keep only the
    # first row's keys).
    keys = sorted({key for row in rows for key in row})
    table = datasets.Dataset.from_dict({key: [row.get(key) for row in rows] for key in keys})
    folder.mkdir()
    (folder / "rows.json").write_text(json.dumps(rows))
    (folder / "wrapped.json").write_text(json.dumps({"data": rows, "version": 1}))
    (folder / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    table.to_parquet(folder / "rows.parquet")
    return {
        "json": folder / "rows.json",
        "json_dict": str(folder / "wrapped.json"),
        "jsonl": folder / "rows.jsonl",
        "parquet": folder / "rows.parquet",
        "dataset": table,
        "list": rows,
    }


def test_every_input_form_gives_identical_examples(chatml, tmp_path):
    results = {
        name: build(source, chatml, tmp_path)
        for name, source in write_sources(ROWS, tmp_path / "src").items()
    }
    reference, ref_summary = results["list"]
    assert ref_summary.examples_out == 4 and ref_summary.skipped == {}
    assert ref_summary.mask_method == "generation"
    for name, (ds, summary) in results.items():
        assert summary.skipped == {}, name
        assert ds["input_ids"] == reference["input_ids"], name
        assert ds["loss_mask"] == reference["loss_mask"], name
        assert (summary.rows_in, summary.tokens, summary.loss_tokens) == (
            ref_summary.rows_in,
            ref_summary.tokens,
            ref_summary.loss_tokens,
        ), name


def test_examples_keep_row_order_and_masks(chatml, tmp_path):
    ds, summary = build(ROWS, chatml, tmp_path)
    decoded = [
        [chatml.decode(ids[a:b]) for a, b in mask_runs(mask)]
        for ids, mask in zip(ds["input_ids"], ds["loss_mask"])
    ]
    assert decoded == [
        ["Paris.<|im_end|>"],
        ["Rome.<|im_end|>", "Yes, Rome.<|im_end|>"],  # ShareGPT human/gpt mapped to user/assistant
        ["def add(a, b):\n    return a + b\n"],  # plain text: every token after BOS
        ["hi<|im_end|>"],
    ]
    text_ids, text_mask = ds[2]["input_ids"], ds[2]["loss_mask"]
    assert text_ids[0] == chatml.bos_token_id and text_mask == [0] + [1] * (len(text_ids) - 1)
    assert summary.tokens == sum(map(len, ds["input_ids"]))
    assert summary.loss_tokens == sum(map(sum, ds["loss_mask"]))


BAD_ROWS = [
    ROWS[0],
    {"prompt": "x"},  # 1 missing_field
    {"messages": [{"role": "user", "content": "hi"}]},  # 2 no_assistant_turn
    {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 3
    {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},  # 4 empty
    {"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]},  # 5
    {"text": 5},  # 6 non_string_content
    "just a string",  # 7 bad_structure
    {"messages": "hello"},  # 8 bad_structure
    ROWS[1],
    {"conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}]},  # 10 role
    {"text": "   "},  # 11 empty_content
    {"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]},  # 12 bad_structure
]


def test_bad_rows_are_counted_per_reason(chatml, tmp_path):
    ds, summary = build(BAD_ROWS, chatml, tmp_path)
    assert summary.skipped == {
        "missing_field": 1,
        "bad_structure": 3,
        "unknown_role": 2,
        "non_string_content": 2,
        "empty_content": 2,
        "no_assistant_turn": 1,
    }
    assert summary.rows_in == len(BAD_ROWS) == summary.examples_out + sum(summary.skipped.values())
    assert len(ds) == summary.examples_out == 2
    assert summary.first_error.startswith("row 1: missing_field")
    assert "skipped unknown_role: 2" in str(summary)


def test_no_examples_at_all_fails_loudly(chatml, tmp_path):
    with pytest.raises(ValueError, match=r"no examples out of 2 rows(.|\n)*row 0: missing_field"):
        build([{"prompt": "x"}, {"text": ""}], chatml, tmp_path)


def test_strict_mode_names_the_row(chatml, tmp_path):
    with pytest.raises(ValueError, match=r"row 1: missing_field"):
        build(BAD_ROWS, chatml, tmp_path, strict=True)
    with pytest.raises(ValueError, match=r"row 2: unknown_role: 'messages'\[0\] has role 'narrator'"):
        build([ROWS[0], ROWS[1], BAD_ROWS[3]], chatml, tmp_path, strict=True)
    # A strict run must not pass just because a lenient run already cached the result.
    build(BAD_ROWS[2:], chatml, tmp_path)
    with pytest.raises(ValueError, match=r"row 0: no_assistant_turn"):
        build(BAD_ROWS[2:], chatml, tmp_path, strict=True)
    _, summary = build(ROWS, chatml, tmp_path, strict=True)
    assert summary.examples_out == len(ROWS)


def test_text_rows_train_on_their_token_ids_in_every_form(chatml, tmp_path):
    """A text row's ``token_ids`` (the target's own tokens) are its example, read from every input form; ids of
    another tokenizer are skipped as ``bad_token_ids`` and named in strict mode (plant: the ids ignored)."""
    piece = lambda text: chatml(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    own = piece("a") + piece(" ") * 2 + piece("b")  # "a  b" as a model may write it; tokenized again it differs
    assert piece("a  b") != own
    rows = [{"text": "a  b", "token_ids": own}, {"text": "c", "token_ids": [10**6]}, {"text": "d"}]
    bos = [] if chatml.bos_token_id is None else [chatml.bos_token_id]
    for name, source in write_sources(rows, tmp_path / "sources").items():
        examples, summary = build(source, chatml, tmp_path / name)
        assert [e["input_ids"] for e in examples] == [bos + own, bos + piece("d")], name
        assert summary.skipped == {"bad_token_ids": 1}, name
    with pytest.raises(ValueError, match=r"row 1: bad_token_ids: 'token_ids' holds 1000000, outside this tokenizer"):
        build(rows, chatml, tmp_path / "strict", strict=True)


def test_template_failures_are_counted(tmp_path):
    non_alternating = chat("a", "b")
    non_alternating["messages"][1]["role"] = "user"
    non_alternating["messages"].append({"role": "assistant", "content": "c"})
    _, summary = build([ROWS[0], ROWS[3], non_alternating], make_chat_tokenizer("mistral_v03"), tmp_path)
    assert summary.skipped == {"template_error": 1, "template_mismatch": 1}  # row 0 has a system prompt
    assert summary.examples_out == 1 and summary.mask_method == "prefix_diff"


def test_truncate_and_drop(chatml, tmp_path):
    long_answer = chat("Count.", "one two three " * 40)
    long_prompt = chat("blah " * 150, "ok")
    rows = [ROWS[3], long_answer, long_prompt]
    full, _ = build(rows, chatml, tmp_path, max_length=10_000)
    lengths = [len(ids) for ids in full["input_ids"]]
    max_length = 64
    assert lengths[0] <= max_length < min(lengths[1:])
    prompt_len = encode_conversation(chatml, long_prompt["messages"])[1].index(1)
    assert prompt_len >= max_length  # truncation leaves row 2 without any assistant token

    cut, summary = build(rows, chatml, tmp_path, max_length=max_length, overlong="truncate")
    assert summary.truncated == 1 and summary.skipped == {"no_loss_after_truncation": 1}
    assert [len(ids) for ids in cut["input_ids"]] == [lengths[0], max_length]
    assert cut[1]["input_ids"] == full[1]["input_ids"][:max_length]
    assert cut[1]["loss_mask"] == full[1]["loss_mask"][:max_length]

    dropped, summary = build(rows, chatml, tmp_path, max_length=max_length, overlong="drop")
    assert summary.truncated == 0 and summary.skipped == {"overlong": 2}
    assert dropped["input_ids"] == [full[0]["input_ids"]]
    assert summary.first_error == f"row 1: overlong: {lengths[1]} tokens > max_length={max_length}"

    with pytest.raises(ValueError, match="overlong='cut'"):
        build(rows, chatml, tmp_path, overlong="cut")


def test_cache_hits_and_misses(chatml, tmp_path, monkeypatch):
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS))

    first, s1 = build(data, chatml, tmp_path)
    second, s2 = build(data, chatml, tmp_path)
    assert not s1.cache_hit and s2.cache_hit and s1.cache_path == s2.cache_path
    assert second["input_ids"] == first["input_ids"] and second["loss_mask"] == first["loss_mask"]
    counts = ("rows_in", "examples_out", "tokens", "loss_tokens", "skipped")
    assert [getattr(s2, c) for c in counts] == [getattr(s1, c) for c in counts]

    def hit(source=data, tokenizer=chatml, **kwargs) -> bool:
        return build(source, tokenizer, tmp_path, **kwargs)[1].cache_hit

    assert not hit(tokenizer=make_chat_tokenizer("chatml"))  # same rendering, different template
    assert not hit(max_length=256)
    assert not hit(overlong="drop")
    assert hit(strict=True)  # strictness does not change the examples
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(data.read_bytes())
    assert hit(copy)  # keyed by content, not by path
    data.write_text(data.read_text() + "\n" + json.dumps(ROWS[0]))
    assert not hit()
    assert hit(ROWS) is False and hit(ROWS) is True  # in-memory rows are keyed by content too

    assert list(workdir.iterdir()) == []  # nothing written to the working directory
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(entries) == 6 and not any(".tmp-" in name for name in entries)


@pytest.mark.parametrize("victim", ["dataset/data-00000-of-00001.arrow", "summary.json", "files.json"])
def test_a_damaged_cache_entry_is_named_and_made_again(chatml, tmp_path, caplog, victim):
    """A cut arrow file was pyarrow's 'Expected to be able to read N bytes', naming no file."""
    first, summary = build(ROWS, chatml, tmp_path)
    first = [list(ids) for ids in first["input_ids"]]  # read now: the dataset maps the file about to be cut
    path = Path(summary.cache_path) / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="draftsmith.data"):
        again, s2 = build(ROWS, chatml, tmp_path)
    if victim == "summary.json":  # an entry without its summary is not one: made again silently
        assert not s2.cache_hit
    else:
        assert not s2.cache_hit and f"the cached data {summary.cache_path} is damaged ({victim}" in caplog.text
    assert [list(ids) for ids in again["input_ids"]] == first and build(ROWS, chatml, tmp_path)[1].cache_hit


def test_default_cache_dir_follows_env(chatml, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "dc"))
    assert default_cache_dir() == tmp_path / "dc" / "data"
    _, summary = build_examples(ROWS, chatml, max_length=64)
    assert summary.cache_path.startswith(str(tmp_path / "dc" / "data"))
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    assert str(default_cache_dir()).endswith(".cache/draftsmith/data")


def test_stdlib_source():
    from draftsmith.data.corpus import corpus_rows

    rows = load_rows("stdlib:heldout")
    assert rows == corpus_rows("heldout") and rows and set(rows[0]) == {"text"}
    with pytest.raises(ValueError, match="nope"):
        load_rows("stdlib:nope")


def test_file_errors_name_the_file(tmp_path):
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_rows(bad_line)
    two_lists = tmp_path / "two.json"
    two_lists.write_text(json.dumps({"a": [], "b": []}))
    with pytest.raises(ValueError, match=r"two.json: .*exactly one list"):
        load_rows(two_lists)
    with pytest.raises(ValueError, match=r"rows.csv: unsupported file type"):
        (tmp_path / "rows.csv").write_text("a,b\n")
        load_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(TypeError, match="DatasetDict"):
        load_rows(datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}))
