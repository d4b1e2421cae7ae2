"""A tree forward then a gather of the accepted path gives the cache (and the next logits) of a fresh forward over
prefix + accepted path; ``infer.cache.crop_dynamic`` cuts a DynamicCache back to a fresh forward's over its first
positions, and refuses sliding-window layers."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target
from transformers.cache_utils import DynamicCache

from draftsmith.heads.layers import HeadCache
from draftsmith.infer.cache import crop_dynamic
from draftsmith.target.model import target_forward
from draftsmith.infer.tree import tree_attention_mask, tree_from_parents


def keep_accepted(cache: DynamicCache | HeadCache, prefix_len: int, nodes: torch.Tensor) -> None:
    """Keep positions ``[0, prefix_len)`` then ``prefix_len + nodes`` (in that order), in place (the generator
    compacts its own ``StaticKVCache`` with ``compact_rows``; this is the same gather on HF's and a head's cache)."""
    src = nodes + prefix_len
    if isinstance(cache, HeadCache):
        cache.select(torch.cat([torch.arange(prefix_len), src]))
        return
    end = prefix_len + src.shape[0]
    for layer in cache.layers:
        kept_k, kept_v = layer.keys.index_select(-2, src), layer.values.index_select(-2, src)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        layer.keys[..., prefix_len:end, :] = kept_k
        layer.values[..., prefix_len:end, :] = kept_v


PARENTS = [-1, 0, 0, 1, 1, 2, 3, 4]  # accepted path below: 0 -> 1 -> 4 -> 7 (not contiguous)
TOKENS = torch.tensor([21, 22, 23, 24, 25, 26, 27, 28])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("path", [[0], [0, 2], [0, 1, 4, 7], [0, 1, 3, 6]])
def test_compaction_equals_fresh_forward(arch, path):
    model = make_tiny_target(arch, dtype=torch.float64)
    prefix = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    tree = tree_from_parents(PARENTS)
    nodes = torch.tensor(path)
    with torch.no_grad():
        cache = target_forward(model, prefix, past_key_values=DynamicCache(), use_cache=True).past_key_values
        target_forward(
            model, TOKENS[None], attention_mask=tree_attention_mask(tree.mask, 6, model.dtype),
            position_ids=(6 + tree.depths)[None], past_key_values=cache, use_cache=True,
        )
        assert cache.get_seq_length() == 6 + len(PARENTS)
        keep_accepted(cache, 6, nodes)
        assert cache.get_seq_length() == 6 + len(path)

        accepted = torch.cat([prefix, TOKENS[nodes][None]], dim=1)
        fresh = target_forward(model, accepted, past_key_values=DynamicCache(), use_cache=True).past_key_values
        for mine, ref in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(mine.values, ref.values, rtol=1e-10, atol=1e-10)

        nxt = torch.tensor([[42, 43]])
        cont = target_forward(model, nxt, past_key_values=cache, use_cache=True)
        full = target_forward(model, torch.cat([accepted, nxt], dim=1))
        torch.testing.assert_close(cont.logits, full.logits[:, -2:], rtol=1e-10, atol=1e-10)


def test_head_cache_select():
    cache = HeadCache()
    k = torch.arange(10.0).view(1, 1, 10, 1).expand(1, 2, 10, 3)
    cache.update(0, k, k + 100)
    keep_accepted(cache, 4, torch.tensor([0, 2, 5]))  # absolute 4, 6, 9
    assert cache.get_seq_length() == 7
    assert cache.keys[0][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert cache.values[0][0, 1, :, 2].tolist() == [100, 101, 102, 103, 104, 106, 109]


def test_crop_equals_a_fresh_forward_and_refuses_sliding_windows():
    model = make_tiny_target("llama", dtype=torch.float64)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = target_forward(model, ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
        crop_dynamic(cache, 5)
        fresh = target_forward(model, ids[:, :5], past_key_values=DynamicCache(), use_cache=True).past_key_values
        assert cache.get_seq_length() == 5
        for mine, ref in zip(cache.layers, fresh.layers):
            torch.testing.assert_close(mine.keys, ref.keys, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(mine.values, ref.values, rtol=1e-10, atol=1e-10)
    with pytest.raises(TypeError, match="crop_dynamic crops a DynamicCache, got a HeadCache"):
        crop_dynamic(HeadCache(), 1)
    model = make_tiny_target("mistral", sliding_window=4)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        target_forward(model, torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="sliding"):
        crop_dynamic(cache, 1)
