"""demo:tiny-hybrid, built micro: a Qwen3.5 hybrid trained on the stdlib by the demo recipe, which loads as a
hybrid, decodes losslessly with n-grams, is named demo:tiny-hybrid, and leaves demo:tiny's cache key alone."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from support.reference import hf_greedy

from draftsmith.data.base.names import public_target_name
from draftsmith.data.demo import demo_target_dir, demo_target_path, ensure_demo_target, fingerprint
from draftsmith.data.demo_lm import SIZES, SUMMARY_FILE, LMSettings, settings_for
from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.recurrent import is_hybrid, layer_types
from draftsmith.target.state_memory import state_memory

# 4 layers (3 Gated DeltaNet + full attention in the 4th), small dims, a slice of the corpus: seconds on CPU.
MICRO = dict(vocab_size=512, hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=128,
             seq_len=128, batch_size=4, max_steps=60, lr=3e-3, eval_tokens=2048, max_corpus_chars=300_000,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)

TINY, HYBRID = SIZES["tiny"], SIZES["tiny-hybrid"]  # the shipped presets (the fixture swaps in the micro one)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """The micro build, also what ``demo:tiny-hybrid`` names while SIZES holds the micro preset."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv("WORLD_SIZE", raising=False)
        mp.setitem(SIZES, "tiny-hybrid", settings_for("tiny-hybrid", **MICRO))
        yield ensure_demo_target("tiny-hybrid", 0, show_progress=False)


def test_micro_hybrid_trains_and_loads_as_a_hybrid(micro):
    summary = json.loads((micro / SUMMARY_FILE).read_text())
    assert summary["settings"]["architecture"] == "qwen3_5" and summary["size"] == "tiny-hybrid"
    assert summary["train_loss_curve"][-1] < summary["train_loss_curve"][0] - 1.0
    assert summary["heldout_loss"] < summary["unigram_heldout_loss"]
    model = AutoModelForCausalLM.from_pretrained(micro)
    assert type(model).__name__ == "Qwen3_5ForCausalLM" and is_hybrid(model)
    assert layer_types(model) == ["linear_attention"] * 3 + ["full_attention"]
    assert model.config.linear_num_value_heads == 2 and model.config.linear_key_head_dim == 16
    assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(micro)) == MICRO["vocab_size"]
    assert state_memory(model.config, 4).layers == 3


def test_micro_hybrid_decodes_losslessly_with_ngrams(micro):
    target = AutoModelForCausalLM.from_pretrained(micro, dtype=torch.float32).eval()
    target.generation_config.eos_token_id = None  # 40 tokens whatever they are: a long comparison
    tok = AutoTokenizer.from_pretrained(micro)
    text = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = hf_greedy(target, ids, 40, pad=tok.pad_token_id)
        got = SpeculativeGenerator(target, NgramDrafter()).generate(ids, max_new_tokens=40)
    assert torch.equal(got, want)


def test_demo_tiny_hybrid_resolves_to_the_build(micro):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTSMITH_CACHE", str(micro.parents[1]))
        mp.setitem(SIZES, "tiny-hybrid", settings_for("tiny-hybrid", **MICRO))
        assert demo_target_path("demo:tiny-hybrid") == str(micro)
        assert micro == demo_target_dir("tiny-hybrid")
    assert micro.name.startswith("tiny-hybrid-seed0-")
    assert public_target_name(str(micro)) == "demo:tiny-hybrid"  # cards and exports name it, not the path


def test_hybrid_fields_stay_out_of_a_llama_cache_key():
    """Adding the hybrid settings must not rename (and so rebuild) every demo:tiny already cached."""
    tiny, hybrid = TINY, HYBRID
    key = dataclasses.asdict(tiny)
    for name in ("architecture", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "mtp_loss_weight"):
        key.pop(name)
    assert tiny.cache_key() == key
    assert fingerprint(dataclasses.replace(tiny, linear_key_head_dim=8), None) == fingerprint(tiny, None)
    assert fingerprint(dataclasses.replace(hybrid, linear_key_head_dim=8), None) != fingerprint(hybrid, None)
    assert fingerprint(hybrid, None) != fingerprint(tiny, None)


def test_hybrid_preset_matches_tiny_but_for_its_mixers_and_bad_values_are_named():
    tiny, hybrid = dataclasses.asdict(TINY), dataclasses.asdict(HYBRID)
    assert {k for k in tiny if tiny[k] != hybrid[k]} == {"architecture"}  # same width, depth, recipe and steps
    with pytest.raises(ValueError, match="architecture"):
        LMSettings(architecture="mamba")
    with pytest.raises(ValueError, match="linear_num_value_heads=3"):
        LMSettings(architecture="qwen3_5", linear_num_key_heads=2, linear_num_value_heads=3)
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        LMSettings(architecture="qwen3_5", linear_key_head_dim=0)


def test_the_hybrid_trains_demo_tinys_tokenizer(micro):
    """Same corpus slice and vocabulary size: the same tokenizer as demo:tiny's, byte for byte, so token ids
    (and demo:assistant, which borrows tiny's) carry over between the two targets."""
    tiny = ensure_demo_target("tiny", 0, show_progress=False,
                              **{**{k: v for k, v in MICRO.items() if not k.startswith("linear_")}, "max_steps": 2})
    assert (tiny / "tokenizer.json").read_bytes() == (micro / "tokenizer.json").read_bytes()
