"""Training on a hybrid target (Qwen3.5: Gated DeltaNet beside gated attention): every head kind trains
online (its loss falls), EAGLE-3 and DFlash give the same losses from stored features as online, the
default aux layers are valid for the hybrid, and the trained head decodes losslessly on it."""
from __future__ import annotations

import pytest
from support import train_fixtures
import torch
from support.hybrids import make_tiny_hybrid
from support.features import QUICK, config_file, losses
from support.train_fixtures import tiny_config

from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.heads import AutoHead
from draftsmith.heads.eagle3 import default_aux_layer_ids
from draftsmith.infer import SpeculativeGenerator
from draftsmith.target.recurrent import LinearAttentionLayer
from draftsmith.scripts.dump_features import main as dump_main
from draftsmith.train.run import setup
from transformers import AutoModelForCausalLM

# transformers >= 5.24 keeps every hybrid layer's state in one cache interface (LinearAttentionLayer)
pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

KINDS = {
    "medusa": ["head.num_heads=3", "train.lr=1e-2"],
    "eagle": ["train.lr=1e-2"],
    "eagle3": ["head.draft_vocab_size=128", "head.ttt_steps=3", "train.lr=1e-2"],
    "dflash": ["head.block_size=4", "train.lr=1e-2"],
    "early-exit": ["head.exit_layer=2"],
}


@pytest.fixture(scope="module")
def hybrid_files(tmp_path_factory):
    """tiny_files' text and tokenizer with a tiny Qwen3.5 (hybrid) target in place of the Llama."""
    root = tmp_path_factory.mktemp("hybrid_train")
    tokenizer = train_tokenizer(train_fixtures.source_texts(), vocab_size=300)
    model = make_tiny_hybrid("qwen3_5_text", vocab=len(tokenizer), num_layers=6, sharpen=40.0)
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return train_fixtures.write_text_files(root)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_trains_on_a_hybrid_and_decodes_losslessly(hybrid_files, tmp_path, kind):
    result = setup(tiny_config(hybrid_files, tmp_path / kind, f"head.kind={kind}", *KINDS[kind]))
    history = losses(result)
    assert len(history) == 4 and history[-1] < history[0], history
    target = AutoModelForCausalLM.from_pretrained(hybrid_files["target"], attn_implementation="sdpa").float().eval()
    target.generation_config.eos_token_id = None
    head = AutoHead.from_pretrained(result.output_dir).float().eval()
    ids = torch.randint(5, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert torch.equal(SpeculativeGenerator(target, head).generate(ids, max_new_tokens=24), ref)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_stored_features_of_a_hybrid_give_the_online_losses(hybrid_files, tmp_path, kind):
    extra = [f"head.kind={kind}", *KINDS[kind], *QUICK]
    online = losses(setup(tiny_config(hybrid_files, tmp_path / "online", *extra)))
    store = tmp_path / "features"
    cfg = tiny_config(hybrid_files, tmp_path / "offline", *extra, f"data.features={store}")
    assert dump_main(["--config", str(config_file(cfg, tmp_path / "cfg.yaml")), "--out", str(store),
                      "--dtype", "float32", "data.features=null"]) == 0
    torch.testing.assert_close(losses(setup(cfg)), online, rtol=0, atol=1e-4)


# the families tests/support/hybrids.py gained after Qwen3.5's: one online EAGLE-3 run each, default aux layers
NEWER = ("lara_mini", "qwen3_5_moe_text", "lfm2_moe", "lfm3", "kimi_linear", "bailing_hybrid", "zamba", "zamba2")


@pytest.mark.parametrize("arch", NEWER)
def test_eagle3_trains_online_on_every_newer_hybrid_family(tmp_path, arch):
    """Online EAGLE-3 steps on the frozen hybrid (its recurrent layers run whole rows, no cache): finite
    losses, and the default aux layers are the kind's for the target's depth, whatever each layer's kind."""
    tokenizer = train_tokenizer(train_fixtures.source_texts(), vocab_size=300)
    model = make_tiny_hybrid(arch, vocab=len(tokenizer))
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    files = train_fixtures.write_text_files(tmp_path)
    result = setup(tiny_config(files, tmp_path / "out", "head.kind=eagle3", *KINDS["eagle3"], *QUICK,
                               "train.max_steps=2", "train.warmup_steps=1"))
    history = losses(result)
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(history))), history
    head = AutoHead.from_pretrained(result.output_dir)
    assert list(head.config.aux_layer_ids) == default_aux_layer_ids(model.config.num_hidden_layers)
