"""The lean stack (target.lean_forward) gives what the target's own backbone gives, bit for bit: logits, final
hidden states, the aux states the heads read and every KV entry, on a left-padded prefill and on a tree verify
after it, for each family it takes (GQA, Qwen3's q/k norms, Mistral's and Qwen's sliding windows), with sdpa and
eager attention. What it cannot reproduce runs the backbone (``lean_stack`` is None): LoRA layers, hooks, training
mode, another family, a stack whose self-check disagrees. The generator runs it at every eager prefill.

Plants (each made once, each failed the test named): ``_rms`` without its float32 cast on a bf16 target
(test_lean_equals_the_backbone[bf16]); Qwen3's q/k norms skipped (test_lean_equals_the_backbone[qwen3-*]); the aux
state taken after the layer instead of before it (every test_lean_equals_the_backbone case); Mistral's mask dict
read as one mask for every layer type
(qwen2-sliding, qwen3-sliding); ``_agrees`` always True (test_a_stack_that_disagrees_is_not_used)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, MellumConfig
from support.reference import hf_greedy
from support.targets import make_tiny_target

from draftsmith.infer.cache import StaticKVCache
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.masked_forward import (attention_masks, masked_forward, prefill_mask, verify_key_positions,
                                             verify_mask)
from draftsmith.target import lean_forward
from draftsmith.target.lean import lean_stack
from draftsmith.target.lean_forward import build_lean_stack

CASES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "qwen2-sliding": dict(arch="qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=3),
    "qwen3": dict(arch="qwen3"),
    "qwen3-sliding": dict(arch="qwen3", use_sliding_window=True, sliding_window=3, max_window_layers=2),
    "mistral-sliding": dict(arch="mistral", sliding_window=3),
    "bf16": dict(arch="llama", dtype=torch.bfloat16),
    "mellum-sliding": dict(arch="mellum"),
}
AUX = (0, 2, 5)


def _mellum(attn: str, mlp_layer_types: list[str]):
    """A tiny dense (or MoE) Mellum, sliding and full layers interleaved, a rotary embedding per layer type."""
    config = MellumConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6, head_dim=8,
                          num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, sliding_window=3,
                          layer_types=["sliding_attention", "full_attention"] * 3, mlp_layer_types=mlp_layer_types,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def _target(case: str, attn: str = "sdpa"):
    kw = dict(CASES[case])
    if kw["arch"] == "mellum":
        return _mellum(attn, ["dense"] * 6)
    return make_tiny_target(kw.pop("arch"), attn_implementation=attn, initializer_range=0.3, **kw)


def _steps(model, lean):
    """A left-padded prefill of two rows (5 and 7 tokens), then a verify of a 4-node tree (two children of the
    root, one grandchild) at each row's length; every output and the cache after each."""
    dtype = model.dtype
    ids = torch.tensor([[0, 0, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    cache = StaticKVCache(len(model.model.layers), 16)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    cache.window = 7
    masks = attention_masks(model.config, prefill_mask(attention, dtype), positions, positions, attention)
    first = masked_forward(model, ids, torch.arange(7), masks, positions, cache, AUX, lean=lean)
    cache.length = 7
    lengths, pads = torch.tensor([7, 7]), torch.tensor([2, 0])
    blocks = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depths = torch.tensor([0, 1, 1, 2])
    tokens = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43]])
    positions = (lengths - pads)[:, None] + depths
    cache.window = 11
    mask = attention_masks(model.config, verify_mask(lengths, pads, blocks.expand(2, -1, -1), 11, dtype), positions,
                           verify_key_positions(lengths, pads, positions, 11))
    second = masked_forward(model, tokens, lengths[:, None] + torch.arange(4)[None], mask, positions, cache, AUX,
                            lean=lean)
    return [first.logits, first.final_hidden, first.aux_hidden, second.logits, second.final_hidden,
            second.aux_hidden, cache.buffer]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_lean_equals_the_backbone(case, attn):
    model = _target(case, attn)
    with torch.inference_mode():
        theirs = _steps(model, None)
        ours = _steps(model, build_lean_stack(model))
    names = ["prefill logits", "prefill hidden", "prefill aux", "verify logits", "verify hidden", "verify aux", "cache"]
    for name, a, b in zip(names, ours, theirs):
        assert torch.equal(a, b), f"{case} {attn}: {name} differ by {(a.float() - b.float()).abs().max().item():.3g}"
    assert lean_stack(model) is not None  # its own check agrees too


def test_what_it_cannot_reproduce_runs_the_backbone():
    lora = get_peft_model(_target("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    assert lean_stack(lora) is None and lean_stack(lora.get_base_model()) is None  # LoRA layers injected in place
    hooked = _target("llama")
    handle = hooked.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean_stack(hooked) is None
    handle.remove()
    assert lean_stack(hooked) is not None
    assert lean_stack(_target("llama").train()) is None
    kernelized = _target("llama")
    kernelized.model.layers[0].input_layernorm.forward = lambda x: x  # a kernel swapped into one norm
    assert lean_stack(kernelized) is None
    other = make_tiny_target("llama")
    other.model.layers[2].mlp = torch.nn.Identity()  # a layer of another shape
    assert lean_stack(other) is None
    assert lean_stack(_mellum("sdpa", ["dense", "sparse"] * 3)) is None  # MoE layers


def test_a_stack_that_disagrees_is_not_used(monkeypatch):
    model = _target("qwen3")
    monkeypatch.setattr(lean_forward, "_rotate_half", lambda x: torch.cat((x[..., 1:], x[..., :1]), dim=-1))
    assert build_lean_stack(model) is not None and lean_stack(model) is None


def test_the_generator_decodes_on_it_and_alike():
    model = _target("qwen3")
    model.generation_config.eos_token_id = None
    gen = SpeculativeGenerator(model, NgramDrafter())
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    out = gen.generate(ids, max_new_tokens=24)
    assert gen._lean is not None  # an eager CPU decode runs the lean stack
    assert torch.equal(out, hf_greedy(model, ids, 24))
    modules = SpeculativeGenerator(model, NgramDrafter(), lean=False)
    assert torch.equal(modules.generate(ids, max_new_tokens=24), out) and modules._lean is None
