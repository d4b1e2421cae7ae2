"""Heads: shapes and parameter counts by hand, parity with stock HF layers, save/load, target checks."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from support.targets import make_tiny_target
from draftsmith.heads import AutoHead, Eagle3Head, EagleHead, HeadCache, MedusaHead, build_head
from draftsmith.heads.layers import Rotary

H, V, I, L = 32, 96, 64, 8  # tiny target dims (make_tiny_target defaults, 8 layers)
NH, NKV, HD = 4, 2, 8


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", num_layers=L)


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_medusa_parameter_count_and_identity_start(target):
    head = build_head("medusa", target, num_heads=3, num_layers=2)
    assert isinstance(head, MedusaHead)
    # per head: 2 blocks of (H*H + H) + lm_head H*V
    assert _count(head) == 3 * (2 * (H * H + H) + H * V)
    hidden = torch.randn(2, 5, H)
    logits = head(hidden)
    assert logits.shape == (3, 2, 5, V)
    # zero-initialised blocks + lm_heads copied from the target: every head starts as the target's lm_head
    expected = target.lm_head(hidden)
    for k in range(3):
        torch.testing.assert_close(logits[k], expected)
    # the blocks are distinct modules (the `[Block] * n` bug would share them)
    assert head.blocks[0].layers[0] is not head.blocks[0].layers[1]
    assert head.blocks[0].layers[0].weight.data_ptr() != head.blocks[1].layers[0].weight.data_ptr()


def test_eagle_parameter_count(target):
    head = build_head("eagle", target)
    attn = H * NH * HD + 2 * H * NKV * HD + NH * HD * H
    mlp = 3 * H * I
    assert _count(head) == 2 * H * H + attn + mlp + H  # fc (no bias) + layer + post-attention norm
    assert "layers.0.input_layernorm.weight" not in head.state_dict()


def test_eagle3_parameter_count_and_buffers(target):
    vd = 40
    head = build_head("eagle3", target, draft_vocab_size=vd)
    attn = 2 * H * NH * HD + 2 * (2 * H * NKV * HD) + NH * HD * H  # q/k/v read 2H
    expected = 3 * H * H + attn + 3 * H * I + 3 * H + H + H * vd  # fc, attn, mlp, 3 norms, norm, lm_head
    assert _count(head) == expected
    assert head.config.aux_layer_ids == [2, L // 2, L - 3]
    assert head.d2t.shape == (vd,) and head.d2t.dtype == torch.long
    assert head.t2d.shape == (V,) and head.t2d.dtype == torch.bool
    full = build_head("eagle3", target)
    assert "d2t" not in full.state_dict() and "t2d" not in full.state_dict()
    assert full.lm_head.weight.shape == (V, H)


def test_eagle3_draft_vocab_mapping(target):
    head = build_head("eagle3", target, draft_vocab_size=5)
    ids = torch.tensor([3, 7, 8, 50, 95])
    head.set_draft_vocab(ids)
    assert torch.equal(head.draft_to_target(torch.arange(5)), ids)
    assert torch.equal(head.draft_vocab_ids(), ids)
    assert int(head.t2d.sum()) == 5 and bool(head.t2d[ids].all())
    for bad, msg in [([3, 2, 8, 50, 95], "strictly increasing"), ([1, 2, 3], "expected draft_vocab_size"), ([1, 2, 3, 4, 96], r"\[0, 96\)")]:
        with pytest.raises(ValueError, match=msg):
            head.set_draft_vocab(bad)


def _gemma3_target():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=L,
                           num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3's norm scales by 1 + weight
def test_eagle3_init_from_target_starts_with_the_targets_output_layer(family):
    tgt = make_tiny_target("llama", num_layers=L) if family == "llama" else _gemma3_target()
    with torch.no_grad():
        torch.nn.init.normal_(tgt.model.norm.weight, std=0.5)  # a norm that is not all ones
    head = build_head("eagle3", tgt, draft_vocab_size=10)
    ids = torch.tensor([0, 3, 7, 8, 20, 33, 50, 64, 90, 95])
    head.set_draft_vocab(ids)
    hidden = torch.randn(2, 5, H)
    before = head.compute_logits(hidden)
    head.init_from_target(tgt)
    with torch.no_grad():
        expected = tgt.lm_head(tgt.model.norm(hidden))[..., ids]  # the target's logits of the draft vocab
    assert not torch.allclose(before, expected, atol=1e-3)
    got = head.compute_logits(hidden)  # the target's logits, tempered by one factor (see init_from_target)
    c = float(((got * expected).sum() / expected.square().sum()).detach())
    assert 0 < c <= 1
    torch.testing.assert_close(got, c * expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_eagle3_init_from_target_refuses_a_norm_it_cannot_copy(target):
    other = make_tiny_target("llama", num_layers=L)
    other.model.norm = torch.nn.LayerNorm(H)  # subtracts the mean: no per-channel scale to copy
    with pytest.raises(ValueError, match="LayerNorm.*not an RMS norm"):
        build_head("eagle3", other).init_from_target(other)
    del other.model.norm
    with pytest.raises(ValueError, match="no final norm"):
        build_head("eagle3", other).init_from_target(other)


def _hf_layer(head_config, layer_weights: dict) -> LlamaDecoderLayer:
    cfg = LlamaConfig(
        hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NKV,
        num_hidden_layers=1, vocab_size=V, attn_implementation="eager",
    )
    layer = LlamaDecoderLayer(cfg, layer_idx=0)
    missing, unexpected = layer.load_state_dict(layer_weights, strict=False)
    assert missing == ["input_layernorm.weight"] and not unexpected
    layer.input_layernorm = torch.nn.Identity()  # EAGLE-1 removes it
    return layer.eval(), LlamaRotaryEmbedding(cfg)


def test_eagle_layer_matches_stock_llama_layer(target):
    """EAGLE-1's decoder layer is a Llama layer without input norm: compare with transformers' own."""
    head = build_head("eagle", target).eval()
    with torch.no_grad():
        for p in head.parameters():  # non-trivial norms too
            p.add_(0.05 * torch.randn_like(p))
    prefix = "layers.0."
    weights = {k[len(prefix):]: v for k, v in head.state_dict().items() if k.startswith(prefix)}
    layer, rotary = _hf_layer(head.config, weights)
    feats, embeds = torch.randn(1, 7, H), torch.randn(1, 7, H)
    pos = torch.arange(7)[None]
    x = head.fc(torch.cat([embeds, feats], -1))
    mask = torch.full((7, 7), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        ours = head(feats, embeds, pos).hidden_states
        theirs = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary_matches_transformers(rope):
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_parameters=dict(rope))
    pos = torch.tensor([[0, 1, 5, 63, 64, 200, 511]])
    cos_hf, sin_hf = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 7, 64), pos)
    cos, sin = Rotary(32, rope)(pos, torch.float32)
    torch.testing.assert_close(cos, cos_hf)
    torch.testing.assert_close(sin, sin_hf)


def test_build_head_reads_target_rope():
    target = make_tiny_target(
        "llama", num_layers=L, rope_parameters={"rope_type": "linear", "rope_theta": 1234.0, "factor": 2.0}
    )
    head = build_head("eagle3", target)
    assert head.config.rope_config == {"rope_type": "linear", "rope_theta": 1234.0, "factor": 2.0}


def test_a_proportional_rope_is_the_linear_rope_over_a_whole_head():
    """LFM3's full-attention rope ("proportional": default frequencies over ``factor`` on part of a head): with
    the partial factor dropped, as heads rotate their whole head_dim, transformers' frequencies are the heads'
    linear rope's."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from draftsmith.heads.common import rope_config_from_target
    from draftsmith.heads.layers import rope_inv_freq

    if "proportional" not in ROPE_INIT_FUNCTIONS:
        pytest.skip("this transformers has no proportional rope (LFM3)")
    params = {"full_attention": {"rope_type": "proportional", "rope_theta": 5000.0, "factor": 2.0,
                                 "partial_rotary_factor": 0.5},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = AutoConfig.for_model("lfm3", hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=params)
    rope = rope_config_from_target(cfg)
    assert rope == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
    whole = AutoConfig.for_model("lfm3", hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters={
        **params, "full_attention": {**params["full_attention"], "partial_rotary_factor": 1.0}})
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](whole, torch.device("cpu"), layer_type="full_attention")
    torch.testing.assert_close(rope_inv_freq(16, rope), theirs)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_incremental_cache_equals_full_forward(target, kind):
    head = build_head(kind, target).eval()
    hidden = torch.randn(1, 9, 3 * H if kind == "eagle3" else H)
    if kind == "eagle3":
        hidden = head.project(hidden)
    embeds = torch.randn(1, 9, H)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        full = head(hidden, embeds, pos).hidden_states
        cache = HeadCache()
        parts = [head(hidden[:, s], embeds[:, s], pos[:, s], past_key_values=cache).hidden_states
                 for s in (slice(0, 4), slice(4, 5), slice(5, 9))]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == 9
    before = cache.keys[0].clone()  # (B, H_kv, 9, D)
    cache.select(torch.tensor([0, 1, 2, 6]))
    assert cache.get_seq_length() == 4
    assert torch.equal(cache.keys[0], before[:, :, [0, 1, 2, 6]])  # kept positions, in the given order
    cache.crop(2)
    assert cache.get_seq_length() == 2 and torch.equal(cache.keys[0], before[:, :, :2])


@pytest.mark.parametrize("kind,opts", [("medusa", {"num_heads": 2}), ("eagle", {}), ("eagle3", {"draft_vocab_size": 32})])
def test_save_reload_identical(tmp_path, target, kind, opts):
    head = build_head(kind, target, **opts)
    if kind == "eagle3":
        head.set_draft_vocab(torch.arange(0, 96, 3))
    head.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["target_hidden_size"] == H and config["target_num_layers"] == L and config["target_vocab_size"] == V
    loaded = AutoHead.from_pretrained(tmp_path)
    assert type(loaded) is type(head)
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # target weights never travel with a head (Medusa's lm_heads are its own)
    assert not any("embed_tokens" in k for k in a)


def test_truncated_checkpoint_fails_loudly(tmp_path, target):
    build_head("eagle", target).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        AutoHead.from_pretrained(tmp_path)
    assert "model.safetensors" in str(err.value) and "incomplete or corrupt" in str(err.value)


@pytest.mark.parametrize("field,override", [("hidden_size", {"hidden_size": 48}), ("num_layers", {"num_layers": 6}), ("vocab_size", {"vocab_size": 100})])
def test_mismatched_target_names_both_values(target, field, override):
    other = make_tiny_target("llama", **{"num_layers": L, **override})
    head = build_head("eagle3", other)
    with pytest.raises(ValueError, match=field) as err:
        head.check_target(target)
    assert str(override[field]) in str(err.value)


def test_bad_options_are_rejected(target):
    with pytest.raises(ValueError, match="unknown head kind 'hydra'"):
        build_head("hydra", target)
    with pytest.raises(ValueError, match="num_head"):
        build_head("medusa", target, num_head=3)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        build_head("eagle3", target, aux_layer_ids=[1, 4, 8])
    with pytest.raises(ValueError, match="draft_vocab_size=200"):
        build_head("eagle3", target, draft_vocab_size=200)


def test_autohead_rejects_foreign_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="not a draftsmith head"):
        AutoHead.from_pretrained(tmp_path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_heads_build_for_other_families(arch):
    target = make_tiny_target(arch, num_layers=L)
    for kind in ("medusa", "eagle", "eagle3"):
        head = build_head(kind, target)
        head.check_target(target)
        assert head.config.target_model_type == arch
    assert isinstance(build_head("eagle", target), EagleHead)
    assert isinstance(build_head("eagle3", target), Eagle3Head)


def test_check_target_skips_unknown_fields_but_checks_feature_layers(target):
    head = build_head("eagle3", target)  # aux [2, 4, 5]
    head.config.target_num_layers = 0  # unknown, as for a public checkpoint imported without its target
    head.check_target(target)
    with pytest.raises(ValueError, match=r"feature layers \[5\] \(head\) vs num_layers=5"):
        head.check_target(make_tiny_target("llama", num_layers=5))
