"""Targets with sliding-window layers decode past the window, token-identical to HF's own greedy
``generate`` (issue 22): every layer sliding (Mistral), sliding and full layers mixed by layer type
(Qwen2's ``max_window_layers``, Qwen3 with interleaved ``layer_types``, Gemma-3 itself: five sliding
layers to one full); one row and a left-padded
batch; oracle drafts (long accepted runs), classic drafters and heads; eager and compiled verify."""
from __future__ import annotations

import random

import pytest
import torch
from support.targets import make_tiny_target
from support.batch import DRAFTERS, PAD, batch_prompts, expected, left_pad, oracle
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.masked_forward import attention_masks, sliding_window

WINDOW = 6
INTERLEAVED = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]


def _gemma3(window: int):
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                              sliding_window=window, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              initializer_range=0.3, attn_implementation="sdpa")
    return Gemma3ForCausalLM(config).eval()


def _tiny(arch: str, **extra):
    return lambda window: make_tiny_target(arch, dtype=torch.float32, initializer_range=0.3,
                                           **{k: (window if v == "W" else v) for k, v in extra.items()})


SLIDING = {  # name -> a model with the given window (the same weights for every window)
    "mistral-all-sliding": _tiny("mistral", sliding_window="W"),
    "qwen2-max-window-layers": _tiny("qwen2", use_sliding_window=True, sliding_window="W", max_window_layers=3),
    "qwen3-interleaved": _tiny("qwen3", use_sliding_window=True, sliding_window="W", layer_types=INTERLEAVED),
    "gemma3": _gemma3,
}


def _build(name: str, window: int = WINDOW):
    model = SLIDING[name](window)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module", params=sorted(SLIDING))
def windowed(request):
    model = _build(request.param)
    assert sliding_window(model.config) == WINDOW  # the window is really on in this config
    return model


def test_the_window_changes_the_target():
    """Each config's window is live in HF's own forward: with a window past the sequence the greedy
    continuation differs (so the identity tests below cannot pass by ignoring the window)."""
    for name in SLIDING:
        model, full = _build(name), _build(name, window=200)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), full.state_dict().values()))
        prompt = torch.tensor([batch_prompts(random.Random(name), [12])[0]])
        a = model.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=PAD, eos_token_id=None)
        b = full.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=PAD, eos_token_id=None)
        assert not torch.equal(a, b), name


@pytest.mark.parametrize("bsz", [1, 3])
def test_oracle_decodes_past_the_window(windowed, bsz):
    rng = random.Random(f"{windowed.config.model_type}-{bsz}")
    prompts = batch_prompts(rng, [rng.randrange(2, 14) for _ in range(bsz)])
    max_new = 30  # prompt + new tokens: several windows
    gen = SpeculativeGenerator(windowed, oracle(windowed, prompts, max_new, depth=5, seed=bsz))
    ids, mask = left_pad(prompts)
    out = gen.generate(ids, attention_mask=mask, max_new_tokens=max_new)
    assert torch.equal(out, expected(windowed, prompts, max_new))
    assert gen.last_stats.tau > 1.5


@pytest.mark.parametrize("name", ["ngram-tree", "eagle3-chain", "eagle-tree", "medusa-tree", "layer-skip"])
def test_drafters_decode_past_the_window(windowed, name):
    rng = random.Random(f"{windowed.config.model_type}-{name}")
    torch.manual_seed(rng.randrange(1000))
    drafter, tree = DRAFTERS[name](windowed)
    prompts = batch_prompts(rng, [rng.randrange(2, 14) for _ in range(2)], repetitive=name.startswith("ngram"))
    ids, mask = left_pad(prompts)
    out = SpeculativeGenerator(windowed, drafter, tree=tree).generate(ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out, expected(windowed, prompts, 24))


def test_compiled_verify_past_the_window():
    model = _build("qwen3-interleaved")
    prompts = batch_prompts(random.Random(5), [9, 4])
    gen = SpeculativeGenerator(model, oracle(model, prompts, 20, depth=4, seed=5), compile="aot_eager")
    ids, mask = left_pad(prompts)
    assert torch.equal(gen.generate(ids, attention_mask=mask, max_new_tokens=20), expected(model, prompts, 20))


def test_window_mask_blocks_exactly_the_far_keys():
    """The rule is HF's: a query at position q sees keys at k with q - k < window."""
    config = make_tiny_target("mistral", sliding_window=3).config
    q = torch.tensor([[4, 5]])
    k = torch.arange(6)[None]
    mask = torch.zeros(1, 1, 2, 6)
    windowed = attention_masks(config, mask, q, k)
    seen = (windowed[0, 0] == 0).int().tolist()
    assert seen == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    assert attention_masks(make_tiny_target("llama").config, mask, q, k) is mask  # no window: unchanged
