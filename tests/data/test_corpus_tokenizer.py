"""The stdlib corpus (selection, split, chunks) and the demo tokenizer (round-trip, specials, chat)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer, LlamaConfig

from draftsmith.data import corpus
from draftsmith.data.tokenizer import BOS, EOS, IM_END, IM_START, PAD, SPECIAL_TOKENS, train_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "A function that returns one?"},
    {"role": "assistant", "content": "def one():\n    return 1\n"},
    {"role": "user", "content": "And\ttabs?"},
    {"role": "assistant", "content": "if True:\n\tpass"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus.split_texts("train")[:60], vocab_size=512)


def test_files_are_sorted_deterministic_and_filtered():
    files = corpus.stdlib_files()
    names = [corpus.relative_name(p) for p in files]
    assert len(files) > 300
    assert names == sorted(names) and len(set(names)) == len(names)
    assert files == corpus.stdlib_files()
    for name in names:
        parts = name.split("/")
        assert not corpus.EXCLUDED_DIRS.intersection(parts[:-1]), name
        assert not parts[-1].startswith("_sysconfigdata"), name
    assert "encodings/cp1252.py" not in names  # a gencodec table
    assert "encodings/utf_8.py" in names and "json/decoder.py" in names


def test_split_is_disjoint_complete_and_stable():
    files = corpus.stdlib_files()
    train, heldout = corpus.split_files("train"), corpus.split_files("heldout")
    assert not set(train) & set(heldout)
    assert sorted(train + heldout, key=files.index) == files
    assert 0.02 < len(heldout) / len(files) < 0.10
    path = heldout[0]
    assert corpus.split_of(path) == corpus.split_of(corpus.relative_name(path)) == "heldout"
    with pytest.raises(ValueError, match="validation"):
        corpus.split_files("validation")


def test_rows_are_deterministic_line_aligned_chunks():
    rows = corpus.corpus_rows("heldout", chunk_chars=2000)
    assert rows == corpus.corpus_rows("heldout", chunk_chars=2000)
    assert all(set(r) == {"text"} and r["text"] for r in rows)
    assert "".join(r["text"] for r in rows) == "".join(corpus.split_texts("heldout"))
    for r in rows:
        # Longer than chunk_chars only when a single line is.
        assert len(r["text"]) <= 2000 or r["text"].count("\n") <= 1
    text = corpus.split_texts("heldout")[0]
    chunks = corpus.chunk_lines(text, 500)
    assert "".join(chunks) == text and len(chunks) > 1
    assert all(c.endswith("\n") for c in chunks[:-1])


def test_fingerprint_is_stable():
    fp = corpus.corpus_fingerprint()
    assert fp == corpus.corpus_fingerprint() and len(fp) == 16


def test_round_trip_on_real_code(tokenizer):
    texts = corpus.split_texts("heldout")[:8]
    texts.append("\tdef f(x):  \r\n\t\treturn x  # tabs, CRLF, trailing spaces\n\n\n    é ∑ 🐍\n")
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert tokenizer("x = 1")["input_ids"][0] != tokenizer.bos_token_id  # nothing is prepended


def test_continuation_prompts_are_heldout_prefixes_with_room_to_continue(tokenizer):
    prompts = corpus.continuation_prompts(tokenizer, num_prompts=5, prompt_tokens=32, min_new_tokens=64)
    assert len(prompts) == 5 and all(len(p) == 32 for p in prompts)
    chunks = [tokenizer(r["text"])["input_ids"] for r in corpus.corpus_rows("heldout")]
    long_enough = [ids[:32] for ids in chunks if len(ids) >= 96]
    assert prompts == long_enough[:5]  # in corpus order, short chunks skipped
    assert len(long_enough) < len(chunks)  # some held-out chunks are too short: the filter is exercised


def test_special_tokens(tokenizer):
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == (PAD, BOS, EOS)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert len(tokenizer) == 512
    for token in SPECIAL_TOKENS:
        assert tokenizer(f"a{token}b")["input_ids"][1:-1] == [tokenizer.convert_tokens_to_ids(token)]


def _check_chat(tok):
    out = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(ids) == len(mask)
    # The masked spans are exactly the assistant replies, each with its <|im_end|>.
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    assert [tok.decode(s) for s in spans] == [m["content"] + IM_END for m in CONVERSATION if m["role"] == "assistant"]
    text = tok.decode(ids)
    assert text.startswith(f"{IM_START}system\nYou write Python.{IM_END}\n{IM_START}user\n")
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(f"A function that returns one?{IM_END}\n{IM_START}assistant\n")
    assert not tok.apply_chat_template(CONVERSATION[:2], tokenize=False).endswith(f"{IM_START}assistant\n")


def test_chat_template_assistant_mask(tokenizer):
    _check_chat(tokenizer)


def test_saved_tokenizer_loads_with_auto_class(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    # Next to a Llama config, as in a demo target: the Auto class must not swap in a Llama tokenizer.
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = corpus.split_texts("heldout")[1]
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)
    _check_chat(loaded)


def test_vocab_too_small_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["x"], vocab_size=100)
