"""demo:tiny-mtp, built micro: a dense Mellum trained with its MTP layer jointly (data.demo_mtp), saved so that
transformers loads the trunk alone and reads the MTP layer itself (``MtpModel.from_pretrained``,
``generate(use_mtp=True)``) under Mellum's release names; its settings leave the other demo LMs' cache keys alone."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_layers import MtpModel

from draftsmith.data.demo import ensure_demo_target, fingerprint
from draftsmith.data.demo_lm import SIZES, SUMMARY_FILE, settings_for

MICRO = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, seq_len=128,
             batch_size=4, max_steps=60, lr=3e-3, eval_tokens=2048, max_corpus_chars=300_000)
PRESETS = dict(SIZES)  # the shipped presets (the fixture swaps in the micro one)
MELLUM_NAMES = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTSMITH_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv("WORLD_SIZE", raising=False)
        mp.setitem(SIZES, "tiny-mtp", settings_for("tiny-mtp", **MICRO))
        yield ensure_demo_target("tiny-mtp", 0, show_progress=False)


def test_micro_trains_its_mtp_layer_with_the_trunk(micro):
    summary = json.loads((micro / SUMMARY_FILE).read_text())
    assert summary["settings"]["architecture"] == "mellum" and summary["settings"]["mtp_loss_weight"] == 0.3
    # 60 steps: both near the unigram baseline (6.9), a random layer far above ln V = 8.3
    uniform = math.log(summary["settings"]["vocab_size"])
    assert summary["heldout_loss"] < uniform - 1 and summary["heldout_mtp_loss"] < uniform - 1
    assert summary["train_loss_curve"][-1] < summary["train_loss_curve"][0] - 2
    tiny = ensure_demo_target("tiny", 0, show_progress=False)  # shipped: the same tokenizer, byte for byte
    assert (tiny / "tokenizer.json").read_bytes() == (micro / "tokenizer.json").read_bytes()


def test_the_checkpoint_carries_the_mtp_layer_under_mellums_names(micro):
    with safe_open(str(micro / "model.safetensors"), framework="pt") as f:
        names = {k for k in f.keys() if k.startswith("mtp.")}
        saved = {k: f.get_tensor(k) for k in names}
    assert MELLUM_NAMES <= names and "mtp.layers.0.mlp.down_proj.weight" in names
    assert not any("embed_tokens" in k or "shared_head" in k for k in names)  # shared with the trunk
    model = AutoModelForCausalLM.from_pretrained(micro, output_loading_info=True)
    model, info = model
    assert type(model).__name__ == "MellumForCausalLM" and model.config.num_mtp_layers == 1
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    mtp = MtpModel.from_pretrained(model)
    layer = mtp.layers[0]
    assert torch.equal(layer.eh_proj.weight, saved["mtp.fc.weight"])
    assert torch.equal(layer.enorm.weight, saved["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(layer.hnorm.weight, saved["mtp.pre_fc_norm_hidden.weight"])
    assert torch.equal(layer.post_norm.weight, saved["mtp.norm.weight"])
    assert torch.equal(layer.mtp_block.mlp.down_proj.weight, saved["mtp.layers.0.mlp.down_proj.weight"])


def test_transformers_drafts_with_it_losslessly(micro):
    model = AutoModelForCausalLM.from_pretrained(micro).eval()
    model.generation_config.eos_token_id = None
    ids = AutoTokenizer.from_pretrained(micro)("import os\n\n\ndef main(argv):\n", return_tensors="pt")["input_ids"]
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, use_mtp=True), plain)


def test_the_mtp_weight_stays_out_of_the_other_cache_keys():
    """Adding mtp_loss_weight must not rename (and so rebuild) demo:tiny or demo:tiny-hybrid."""
    for size in ("tiny", "tiny-hybrid"):
        settings = PRESETS[size]
        assert "mtp_loss_weight" not in settings.cache_key()
        assert fingerprint(dataclasses.replace(settings, mtp_loss_weight=1.0), None) == fingerprint(settings, None)
    mtp = PRESETS["tiny-mtp"]
    assert fingerprint(dataclasses.replace(mtp, mtp_loss_weight=1.0), None) != fingerprint(mtp, None)
    tiny, ours = dataclasses.asdict(PRESETS["tiny"]), dataclasses.asdict(mtp)
    assert {k for k in tiny if tiny[k] != ours[k]} == {"architecture", "max_steps"}  # tiny's size and recipe


@torch.no_grad()
def test_the_saved_layer_is_the_trained_one(micro):
    """The MTP layer as transformers reads it back scores the held-out loss the build recorded from the layer it
    trained (a name mixed up on the way to the checkpoint reads another layer)."""
    import torch.nn.functional as F

    from draftsmith.data.corpus import split_texts
    from draftsmith.data.demo_lm import _limit, pack

    settings = json.loads((micro / SUMMARY_FILE).read_text())
    model = AutoModelForCausalLM.from_pretrained(micro).eval()
    mtp = MtpModel.from_pretrained(model).eval()
    s = settings["settings"]
    blocks = pack(AutoTokenizer.from_pretrained(micro), _limit(split_texts("heldout"), s["max_corpus_chars"]),
                  s["seq_len"])[: s["eval_tokens"] // s["seq_len"]]
    hidden = model.model(input_ids=blocks).last_hidden_state
    positions = torch.arange(1, blocks.shape[1])[None]
    out = mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=blocks[:, 1:])
    logits = model.lm_head(out[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 2:].reshape(-1))
    assert abs(loss.item() - settings["heldout_mtp_loss"]) < 2e-4, (loss.item(), settings["heldout_mtp_loss"])
