"""transformers' cache keyword (target.cache_keywords): the decode path runs with either call convention,
``cache=`` (5.24 on) and ``past_key_values=`` (5.17), with the same greedy output as the target's own
generate; with the installed one, none of our calls raises transformers' deprecation warning."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from support.targets import make_tiny_target
from transformers import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils.generic import ModelOutput

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.target import cache_keywords
from draftsmith.infer.drafters import DynamicTree, make_drafter
from draftsmith.infer.drafters.free.hierarchical import HierarchicalDrafter
from draftsmith.infer.drafters.free.layer_skip import LayerSkipDrafter
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.model import target_forward

VOCAB = 96
NEW_NAME = "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}  # transformers >= 5.24


def _target(seed: int = 0, num_layers: int = 6):
    model = make_tiny_target("llama", vocab_size=VOCAB, initializer_range=0.3, seed=seed, num_layers=num_layers)
    model.generation_config.eos_token_id = None
    return model


def _generators(target):
    """Every drafter that calls a transformers forward with a cache: a head drafter (the target's
    prefill and verify), the early-exit head (the target's first layers), a draft LM under n-grams,
    and layer-skip (the target's first layers in its own cache)."""
    torch.manual_seed(0)
    return {
        "eagle3-tree": SpeculativeGenerator(target, make_drafter(build_head("eagle3", target), target,
                                                                 DynamicTree(depth=2, top_k=2, total_tokens=5))),
        "early-exit": SpeculativeGenerator(target, make_drafter(build_head("early-exit", target, exit_layer=2),
                                                                target, Chain(3))),
        "hierarchical": SpeculativeGenerator(target, HierarchicalDrafter(_target(seed=7, num_layers=2), target,
                                                                         NgramDrafter(length=3), Chain(3))),
        "layer-skip": SpeculativeGenerator(target, LayerSkipDrafter(target, 2, Chain(3))),
    }


def _decode_all(target) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 12]])
    return {name: gen.generate(ids, max_new_tokens=12) for name, gen in _generators(target).items()}


def _hf(target) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 12]])
    return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                           eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    return _target()


def test_installed_convention_decodes_without_deprecation_warnings(target, monkeypatch):
    if NEW_NAME:  # reading the deprecated alias of a returned cache fails the test too (transformers only logs it)
        def alias(self):
            raise AssertionError("out.past_key_values read on a transformers that returns out.cache")

        monkeypatch.setattr(ModelOutput, "past_key_values", property(alias))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        outs = _decode_all(target)
        prefill = target_forward(target, torch.tensor([[1, 5, 9]]), past_key_values=DynamicCache(), use_cache=True)
    want = _hf(target)
    for name, out in outs.items():
        assert torch.equal(out, want), name
    assert prefill.past_key_values.get_seq_length() == 3
    assert cache_keywords._keyword(type(target.model)) == ("cache" if NEW_NAME else "past_key_values")


def test_old_convention_decodes_the_same(target, monkeypatch):
    """``past_key_values=`` everywhere, as on transformers 5.17 (5.24 maps it to ``cache`` with a warning)."""
    calls, ours = [], cache_keywords._keyword

    def old(cls):  # transformers' classes take the old name; ours (EarlyExitLM) keep theirs
        if not cls.__module__.startswith("transformers."):
            return ours(cls)
        calls.append(cls.__name__)
        return "past_key_values"

    monkeypatch.setattr(cache_keywords, "_keyword", old)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        outs = _decode_all(target)
    want = _hf(target)
    for name, out in outs.items():
        assert torch.equal(out, want), name
    assert set(calls) == {"LlamaModel", "LlamaForCausalLM"}, calls  # backbones, shallow stacks, the draft LM


def test_keyword_is_read_from_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None):
            return input_ids

    class Neither(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    cache = DynamicCache()
    assert cache_keywords.cache_kwargs(Old(), cache) == {"past_key_values": cache}
    assert cache_keywords.cache_kwargs(New(), cache) == {"cache": cache}
    with pytest.raises(TypeError, match="Neither.forward takes no KV cache"):
        cache_keywords.cache_kwargs(Neither(), cache)
