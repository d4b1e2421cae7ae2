"""A micro demo target: trains, learns, loads with the Auto classes, and is cached by key."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.tokenizer import IM_END
from draftsmith.data.demo import damaged_files, demo_target_dir, ensure_demo_target, is_built
from draftsmith.data.demo_lm import EMBED_INIT_STD, SIZES, SUMMARY_FILE, LMSettings, build_model, settings_for
from support.house import REPO

SCRIPT = REPO / "scripts" / "make_demo_target.py"

# Tiny dims and a slice of the corpus: trains in a few seconds on 2 CPU cores.
MICRO = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
             seq_len=64, batch_size=8, max_steps=120, lr=3e-3, eval_tokens=4096, max_corpus_chars=400_000)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("cache")
        mp.setenv("DRAFTSMITH_CACHE", str(root))
        mp.delenv("WORLD_SIZE", raising=False)
        yield root


@pytest.fixture(scope="module")
def micro(cache):
    return ensure_demo_target("tiny", 0, show_progress=False, **MICRO)


def test_micro_target_learns(micro):
    summary = json.loads((micro / SUMMARY_FILE).read_text())
    curve = summary["train_loss_curve"]
    assert curve[-1] < curve[0] - 1.0
    # Genuinely trained: clearly better than predicting token frequencies.
    assert summary["heldout_loss"] < summary["unigram_heldout_loss"] - 0.2
    assert summary["tokens_seen"] == MICRO["max_steps"] * MICRO["batch_size"] * MICRO["seq_len"]
    assert summary["settings"] == dataclasses.asdict(settings_for("tiny", seed=0, **MICRO))


def test_micro_target_loads_with_auto_classes(micro):
    model = AutoModelForCausalLM.from_pretrained(micro).eval()
    tok = AutoTokenizer.from_pretrained(micro)
    assert (micro / "model.safetensors").is_file()
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == MICRO["num_layers"]
    assert model.config.vocab_size == len(tok) == MICRO["vocab_size"]
    assert model.config.max_position_embeddings == MICRO["seq_len"]
    assert set(model.generation_config.eos_token_id) == {tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)}
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write `json`."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_cache_reuses_directory(micro, cache):
    assert micro == demo_target_dir("tiny", 0, **MICRO)
    assert micro.parent == cache / "demo" and micro.name.startswith("tiny-seed0-")
    stamp = (micro / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_target("tiny", 0, show_progress=False, **MICRO) == micro
    assert (micro / "model.safetensors").stat().st_mtime_ns == stamp
    # Any change in settings is a different cache entry.
    assert demo_target_dir("tiny", 0, **{**MICRO, "max_steps": 7}) != micro
    assert demo_target_dir("tiny", 1, **MICRO) != micro
    assert not list(cache.glob("demo/.*tmp*"))


def test_mismatching_out_dir_is_refused(micro, tmp_path):
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="occupied"):
        ensure_demo_target("tiny", 0, out_dir=tmp_path / "occupied", show_progress=False, **MICRO)
    fp = json.loads((micro / SUMMARY_FILE).read_text())["fingerprint"]
    assert is_built(micro, fp) and not is_built(micro, "0" * 12)


def test_a_damaged_cached_target_is_named_and_rebuilt(cache, capsys):
    """A cut model.safetensors in the cache made every later use fail in safetensors' traceback."""
    # builds four times: a slice of MICRO's corpus slice (each build ~6.6 -> ~2 s here; damage is not about training)
    settings = {**MICRO, "max_steps": 4, "max_corpus_chars": 50_000}
    out = ensure_demo_target("tiny", 0, show_progress=False, **settings)
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(summary["files"])
    assert damaged_files(out) == []
    for name, damage in [("model.safetensors", lambda b: b[:-1000]), ("config.json", lambda b: b.replace(b"64", b"65"))]:
        path = out / name
        path.write_bytes(damage(path.read_bytes()))
        assert damaged_files(out) == [name] and not is_built(out, summary["fingerprint"])
        capsys.readouterr()
        assert ensure_demo_target("tiny", 0, show_progress=False, **settings) == out
        assert f"the cached demo target {out} is damaged ({name} missing or changed" in capsys.readouterr().err
        assert damaged_files(out) == []
        AutoModelForCausalLM.from_pretrained(out)
    # A flipped weight byte with the record removed from the summary: refused and rebuilt, never recorded as
    # the truth (it was: a summary without a record got one from whatever the files held)
    good = (out / "model.safetensors").read_bytes()
    tampered = bytearray(good)
    tampered[-10] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(tampered))
    del summary["files"]
    (out / SUMMARY_FILE).write_text(json.dumps(summary))
    assert damaged_files(out) == [SUMMARY_FILE] and not is_built(out, summary["fingerprint"])
    assert "files" not in json.loads((out / SUMMARY_FILE).read_text())  # nothing recorded from the tampered file
    capsys.readouterr()
    assert ensure_demo_target("tiny", 0, show_progress=False, **settings) == out
    assert f"the cached demo target {out} is damaged ({SUMMARY_FILE} missing or changed" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() != bytes(tampered) and damaged_files(out) == []


def test_missing_target_in_distributed_launch_raises(cache, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="make_demo_target.py"):
        ensure_demo_target("tiny", 0, show_progress=False, **{**MICRO, "max_steps": 3})


def _load_script():
    spec = importlib.util.spec_from_file_location("make_demo_target", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_makes_assistant_sharing_the_tokenizer(micro, tmp_path, monkeypatch):
    import draftsmith.data.demo_lm as demo_lm

    # MICRO's corpus slice and held-out tokens (the whole corpus: ~13 s of tokenizing and scoring here); the
    # preset's model, the script's path and the shared tokenizer are what this test is about
    monkeypatch.setitem(demo_lm.SIZES, "assistant", dataclasses.replace(
        SIZES["assistant"], max_corpus_chars=MICRO["max_corpus_chars"], eval_tokens=MICRO["eval_tokens"]))
    out = _load_script().main(["--out", str(tmp_path / "assistant"), "--size", "assistant",
                                 "--tokenizer", str(micro), "--max-steps", "3"])
    assert out == tmp_path / "assistant"
    assert (out / "tokenizer.json").read_bytes() == (micro / "tokenizer.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == MICRO["vocab_size"]
    assert model.config.num_hidden_layers == SIZES["assistant"].num_layers
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["tokenizer_source"] == str(micro) and summary["settings"]["max_steps"] == 3


def test_init_scales_residual_outputs_and_embeddings(micro):
    settings = settings_for("tiny", hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    model = build_model(settings, AutoTokenizer.from_pretrained(micro))
    out_std = model.config.initializer_range / math.sqrt(2 * settings.num_layers)
    for layer in model.model.layers:
        for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            assert abs(weight.std().item() - out_std) < 0.1 * out_std
        assert abs(layer.self_attn.q_proj.weight.std().item() - model.config.initializer_range) < 0.002
    assert abs(model.model.embed_tokens.weight.std().item() - EMBED_INIT_STD) < 0.02


def test_presets_and_validation():
    assert SIZES["tiny"].num_layers >= 8
    assert SIZES["assistant"].num_layers < SIZES["tiny"].num_layers
    with pytest.raises(ValueError, match="num_kv_heads"):
        LMSettings(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="max_steps"):
        settings_for("tiny", max_steps=0)
    with pytest.raises(ValueError, match="huge"):
        settings_for("huge")


def test_building_a_demo_target_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    import draftsmith.data.demo as demo

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))

    def fake_train(out, settings, **kwargs):  # the 12-minute part, skipped
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / SUMMARY_FILE).write_text("{}")

    monkeypatch.setattr(demo, "train_lm", fake_train)
    monkeypatch.setattr(demo, "SHIPPED", tmp_path / "nothing-shipped")  # else demo:tiny is copied, not built
    demo.ensure_demo_target("tiny")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "building the demo target demo:tiny" in err[0] and "minutes" in err[0], err
