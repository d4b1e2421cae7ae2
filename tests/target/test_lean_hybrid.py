"""The hybrid stack (target.lean_hybrid) gives what the hybrid's own backbone gives, bit for bit: logits, final hidden
states, aux states, every KV entry and every recurrent and conv state, recorded per position or not, on a left-padded
prefill, a recorded 4-token verify (with the generator's routing) and a one-token step, for each family it takes
(Qwen3.5's Gated DeltaNet, its mixers as ops, with gated attention and mRoPE; Bamba's Mamba-2 with partial rotary;
LFM2's short conv), in float32 and bfloat16. What it cannot
reproduce runs the backbone; the generator runs it at every eager prefill and decodes alike either way.

Plants (each made once, each failed the test named): Qwen3.5's norms read as Llama's x * w instead of x * (1 + w)
(test_hybrid_stack_equals_the_backbone[qwen3_5_text]); the aux state taken after the layer instead of before it
(test_hybrid_stack_equals_the_backbone); the norm before the mixer read before the MLP too (caught only once the
test's norms were set apart: ``_norms_apart``); LFM2's MLP with its gate and up projections swapped
(test_hybrid_stack_equals_the_backbone[lfm2]); every recurrent mixer given the attention layers' mask
(test_hybrid_stack_equals_the_backbone); ``_agrees`` checking the prompt alone (test_the_check_runs_cached_steps);
in the lean Gated DeltaNet: its gate's float32 cast dropped (test_hybrid_stack_equals_the_backbone[qwen3_5_text-bf16]),
g scaled by 1.0001 and the conv's activation dropped (test_hybrid_stack_equals_the_backbone[qwen3_5_text])."""
from __future__ import annotations

import copy
import random
from contextlib import nullcontext

import pytest
import torch
from support.infer_hybrid import hybrid_prompt, hybrid_target
from support.oracle import Oracle
from support.reference import hf_greedy

from draftsmith.infer.cache import StaticKVCache
from draftsmith.infer.generator import SpeculativeGenerator
from draftsmith.infer.masked_forward import attention_masks, masked_forward, prefill_mask
from draftsmith.target import lean_forward, lean_hybrid, positions
from draftsmith.target.delta_rule import per_token_modules, per_token_rule
from draftsmith.target.lean import build_stack, lean_stack
from draftsmith.target.lean_hybrid import HybridStack, LeanGatedDeltaNet

ARCHS = ("qwen3_5_text", "bamba", "lfm2")
AUX = (0, 1, 3)


def _states(cache: StaticKVCache) -> list[torch.Tensor]:
    out = []
    for i in sorted(cache.states.layers):
        out += [cache.get_conv_state(i), cache.get_recurrent_state(i)]
    return [t for t in out if t is not None]  # a short-conv layer keeps no recurrent state


def _steps(model, lean) -> list[torch.Tensor]:
    """A left-padded prefill of two rows (5 and 7 tokens); a recorded 4-token chain verify at each row's length,
    each row keeping another count of it; then one token. Every output, the KV buffer and the states after each."""
    dtype = model.dtype
    ids = torch.tensor([[0, 0, 11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27]])
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    cache = StaticKVCache(len(model.model.layers), 16)
    pos = (attention.cumsum(1) - 1).clamp(min=0)
    cache.window = 7
    masks = attention_masks(model.config, prefill_mask(attention, dtype), pos, pos, attention)
    outs = [masked_forward(model, ids, torch.arange(7), masks, pos, cache, AUX, lean=lean)]
    seen = [t.clone() for t in _states(cache)]
    for tokens, width, kept in ((torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43]]), 11, [2, 3]),
                                (torch.tensor([[34], [44]]), 12, None)):
        n = tokens.shape[1]
        start = cache.length if cache.length else 7
        slots = torch.arange(start, start + n)
        pos = (torch.tensor([start, start])[:, None] - torch.tensor([2, 0])[:, None]) + torch.arange(n)[None]
        cache.window = start + n
        allowed = torch.ones(n, start + n, dtype=torch.bool).tril_(start)[None].repeat(2, 1, 1)
        allowed[0, :, :2] = False  # row 0's left pads
        mask = torch.zeros(2, 1, n, start + n, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        mask = attention_masks(model.config, mask, pos, pos)
        with per_token_rule(per_token_modules(model)), positions.recording() if kept else nullcontext():
            outs.append(masked_forward(model, tokens, slots, mask, pos, cache, AUX, lean=lean))
        if kept:
            cache.states.keep(kept)
        cache.length = start + n
        seen += [t.clone() for t in _states(cache)]
    return [t for o in outs for t in (o.logits, o.final_hidden, o.aux_hidden)] + [cache.buffer, *seen]


@pytest.mark.parametrize("arch", [*ARCHS, *(f"{a}-bf16" for a in ARCHS)])
def test_hybrid_stack_equals_the_backbone(arch):
    arch, _, dtype = arch.partition("-")
    model = _norms_apart(hybrid_target(arch))
    if dtype:
        model = model.to(torch.bfloat16)
    stack = build_stack(model)
    assert isinstance(stack, HybridStack)
    lean_mixers = [layer.mixer for layer in stack.layers if isinstance(layer.mixer, LeanGatedDeltaNet)]
    assert len(lean_mixers) == (3 if arch == "qwen3_5_text" else 0)  # Qwen3.5's mixers as ops, Bamba's their forward
    with torch.inference_mode():
        theirs = _steps(model, None)
        ours = _steps(model, stack)
    assert len(ours) == len(theirs) > 10
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"{arch}: output {i} differs by {(a - b).abs().max().item():.3g}"
    assert lean_stack(model) is not None  # its own check agrees too


def _norms_apart(model):
    """A copy of ``model`` whose norms' weights differ from their init and from each other (a norm read in another's
    place shows)."""
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def test_what_it_cannot_reproduce_runs_the_backbone():
    hooked = hybrid_target("bamba", seed=1)
    handle = hooked.model.layers[0].mamba.register_forward_hook(lambda *a: None)
    assert lean_stack(hooked) is None
    handle.remove()
    assert lean_stack(hooked) is not None
    assert lean_stack(hybrid_target("qwen3_5_text", seed=1).train()) is None
    hybrid_target("qwen3_5_text", seed=1).eval()
    other = hybrid_target("qwen3_5_text", seed=2)
    mlp = other.model.layers[1].mlp
    other.model.layers[1].mlp = torch.nn.Sequential()  # a layer of another shape
    assert lean_stack(other) is None
    other.model.layers[1].mlp = mlp
    for arch in ("nemotron_h", "qwen3_next", "falcon_h1"):  # families it does not take
        assert lean_stack(hybrid_target(arch)) is None


def test_a_stack_that_disagrees_is_not_used(monkeypatch):
    model = hybrid_target("qwen3_5_text", seed=3)
    monkeypatch.setattr(lean_hybrid, "_norm", _weight_norm)  # every norm read as Llama's: x * w, not x * (1 + w)
    assert build_stack(model) is not None and lean_stack(model) is None


def _weight_norm(module):
    return lean_forward.rms, module.weight, getattr(module, "variance_epsilon", getattr(module, "eps", None))


def test_the_check_runs_cached_steps(monkeypatch):
    """A stack right on a prompt and wrong once a state is carried fails the check: here the mixers' cache taken
    away (the prompt's output is the same; the next step's is not)."""
    model = hybrid_target("bamba", seed=3)
    real = HybridStack.__call__

    def stateless(self, input_ids, mask, pos, cache, aux_layer_ids=()):
        fresh = cache if cache.get_seq_length() == 0 else type(cache)(config=model.config)
        return real(self, input_ids, mask, pos, fresh, aux_layer_ids)

    monkeypatch.setattr(HybridStack, "__call__", stateless)
    assert lean_stack(model) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_the_generator_decodes_on_it_and_alike(arch):
    model = hybrid_target(arch)
    ids = hybrid_prompt(random.Random(5), 14)
    ref = hf_greedy(model, ids, 40)
    gen = SpeculativeGenerator(model, Oracle(ref, right=3))  # a partial accept every step: a recorded rollback each
    out = gen.generate(ids, max_new_tokens=40)
    assert isinstance(gen._lean, HybridStack) and torch.equal(out, ref)
    modules = SpeculativeGenerator(model, Oracle(ref, right=3), lean=False)
    assert torch.equal(modules.generate(ids, max_new_tokens=40), out) and modules._lean is None
    assert gen.last_stats.tau == modules.last_stats.tau
