"""An MTP head's layers run as target.lean_mtp runs them give what transformers' ``MtpLayer`` modules give, bit for
bit, over several cached steps (a dense Mellum block with q/k norms and a rotary per layer type, and a Llama one with
the hidden state first); the MTP drafter runs them on an eager decode and decodes as the modules do; what the lean
layer cannot reproduce (an MoE block, a hook, a disagreeing self-check) runs the modules.

Plants (each made once, each failed the test named): enorm and hnorm swapped (test_lean_equals_the_module[*]); the
``mtp_hidden_states_first`` order ignored (test_lean_equals_the_module[llama-hidden-first]); post_norm skipped
(test_lean_equals_the_module[*]); the self-check always agreeing (test_what_it_cannot_reproduce_runs_the_modules)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MellumConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import MtpLayer
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.mellum.modeling_mellum import MellumDecoderLayer, MellumRMSNorm, MellumRotaryEmbedding
from support.reference import hf_greedy

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.target import lean_mtp
from draftsmith.target.lean_mtp import LeanMtpLayer, lean_mtp_layers

MELLUM = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, sliding_window=64,
              layer_types=["sliding_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _layer(case: str):
    """(an MtpLayer in eval mode with every weight random, its rotary, the rotary's layer type or None)."""
    torch.manual_seed(0)
    if case == "mellum":
        config = MellumConfig(**MELLUM)
        layer, rotary, rope = MtpLayer(config, MellumDecoderLayer, MellumRMSNorm, 1), MellumRotaryEmbedding(config), \
            ("full_attention",)
    else:
        config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
        config.mtp_hidden_states_first = True
        layer, rotary, rope = MtpLayer(config, LlamaDecoderLayer, LlamaRMSNorm, 0), LlamaRotaryEmbedding(config), ()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return layer.eval(), rotary, rope


@pytest.mark.parametrize("case", ["mellum", "llama-hidden-first"])
def test_lean_equals_the_module(case):
    layer, rotary, rope = _layer(case)
    lean = LeanMtpLayer(layer)
    caches = DynamicCache(config=layer.config), DynamicCache(config=layer.config)
    gen = torch.Generator().manual_seed(1)
    start = 0
    for t in (4, 1, 1, 3):  # a prefix, two draft levels, a verify's accepted tokens
        embeds, hidden = torch.randn(2, t, 32, generator=gen), torch.randn(2, t, 32, generator=gen)
        positions = torch.arange(start, start + t)[None].expand(2, -1)
        mask = None
        if t > 1 and start:
            allowed = torch.ones(t, start + t, dtype=torch.bool).tril_(start)
            mask = torch.zeros(2, 1, t, start + t).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        emb = rotary(embeds, positions, *rope)
        with torch.inference_mode():
            ours = lean(embeds, hidden, emb, mask, positions, caches[0])
            theirs = layer(embeds, hidden, emb, mask, positions, caches[1])
        assert torch.equal(ours, theirs), (case, t, (ours - theirs).abs().max().item())
        start += t
    assert lean_mtp_layers(torch.nn.ModuleList([layer]), rotary, list(rope) or None) is not None


def test_what_it_cannot_reproduce_runs_the_modules(monkeypatch):
    config = MellumConfig(**dict(MELLUM, mlp_layer_types=["sparse", "sparse"]))
    moe = MtpLayer(config, MellumDecoderLayer, MellumRMSNorm, 0).eval()
    assert lean_mtp_layers(torch.nn.ModuleList([moe]), MellumRotaryEmbedding(config), None) is None
    layer, rotary, rope = _layer("mellum")
    handle = layer.mtp_block.register_forward_hook(lambda *a: None)
    assert lean_mtp_layers(torch.nn.ModuleList([layer]), rotary, list(rope)) is None
    handle.remove()
    layer, rotary, rope = _layer("mellum")
    monkeypatch.setattr(lean_mtp, "rms", lambda x, w, eps: w * x)  # the lean layer's norms planted wrong
    assert lean_mtp_layers(torch.nn.ModuleList([layer]), rotary, list(rope)) is None


def test_the_drafter_decodes_on_it_and_alike(monkeypatch):
    from transformers import AutoModelForCausalLM

    from draftsmith.infer.drafters import mtp

    config = MellumConfig(**dict(MELLUM, num_mtp_layers=1, mtp_mlp_layer_types=["dense"]))
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    target.generation_config.eos_token_id = None
    head = build_head("mtp", target, init="fresh").eval()
    ids = torch.tensor([[5, 6, 7, 8, 5, 6]])
    gen = SpeculativeGenerator(target, head, tree=Chain(3))
    out = gen.generate(ids, max_new_tokens=20)
    assert gen.drafter._lean is not None  # an eager decode drafts on the lean layer
    assert torch.equal(out, hf_greedy(target, ids, 20))
    monkeypatch.setattr(mtp, "lean_mtp_layers", lambda *a: None)
    modules = SpeculativeGenerator(target, head, tree=Chain(3))
    assert torch.equal(modules.generate(ids, max_new_tokens=20), out) and modules.drafter._lean is None
    assert modules.last_stats.steps == gen.last_stats.steps  # the same drafts, kept alike
