"""An EAGLE-3 head's draft step without the module machinery, op for op as its forward (eager drafting).

On a small head a draft step is mostly Python: ``Eagle3Head.forward`` calls about 17 modules (norms, projections,
the rotary, attention, MLP), each through ``nn.Module.__call__``, and reads an instrumented config, where its
arithmetic is a few matrix-vector products (docs/benchmarks.md, "The draft step without its modules"). ``LeanEagle3``
runs ``Eagle3Head.forward``'s tensor ops in the same order on the same weights (``heads.eagle3``'s decoder layer:
both norms and the rotary through their own ``forward``, the concatenation, attention over the head's cache with
projections as ``F.linear``, the gated MLP, EAGLE-3.1's output norm), so a draft is the module's bit for bit;
``lean_eagle3`` checks that once per head on a short input with a cache and returns None (the drafter runs the
modules) where it differs or where a module is not the plain class the head builds (a LoRA or quantized linear, a
hook, training mode, a variant's head).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.heads.layers import MLP, Attention, HeadCache, RMSNorm, Rotary, causal_mask, rotate_half
from draftsmith.target.lean_forward import NotLean, linear_weights


def _norm(module: nn.Module):
    """The norm's own ``forward`` (bound: no ``__call__``)."""
    if type(module) is not RMSNorm:
        raise NotLean(f"{type(module).__name__} is not heads.layers.RMSNorm")
    return module.forward


class LeanEagle3:
    """One ``Eagle3Head`` (variant eagle3) as tensors; called with ``Eagle3Head.forward``'s arguments, it returns
    the forward's ``hidden_states``."""

    def __init__(self, head: nn.Module) -> None:
        from draftsmith.heads.eagle3 import Eagle3DecoderLayer, Eagle3Head

        if type(head) is not Eagle3Head or type(head.midlayer) is not Eagle3DecoderLayer:
            raise NotLean(f"a {type(head).__name__}")
        if head.training:
            raise NotLean("training mode")
        layer = head.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not Attention or type(mlp) is not MLP or type(head.rotary) is not Rotary:
            raise NotLean("a module of another class")
        for module in head.modules():
            if module._forward_hooks or module._forward_pre_hooks:
                raise NotLean(f"a hook on {type(module).__name__}")
        self.rotary = head.rotary
        self.norm_embeds, self.norm_hidden = _norm(layer.input_layernorm), _norm(layer.hidden_norm)
        self.norm_post = _norm(layer.post_attention_layernorm)
        self.norm_out = _norm(head.norm) if head.config.norm_output else None
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        self.q, self.k, self.v, self.o = (linear_weights(m) for m in projections)
        self.gate, self.up, self.down = (linear_weights(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.act = mlp.act_fn.forward if isinstance(mlp.act_fn, nn.Module) else mlp.act_fn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.layer_idx = attn.layer_idx

    def __call__(self, hidden_states: Tensor, inputs_embeds: Tensor, position_ids: Tensor,
                 attention_mask: Tensor | None = None, past_key_values: HeadCache | None = None) -> Tensor:
        cos, sin = self.rotary.forward(position_ids, hidden_states.dtype)
        hidden = hidden_states
        x = torch.cat([self.norm_embeds(inputs_embeds), self.norm_hidden(hidden)], dim=-1)
        hidden = hidden + self._attention(x, cos, sin, attention_mask, past_key_values)
        x = self.norm_post(hidden)
        hidden = hidden + F.linear(self.act(F.linear(x, *self.gate)) * F.linear(x, *self.up), *self.down)
        return self.norm_out(hidden) if self.norm_out is not None else hidden

    def _attention(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache) -> Tensor:
        """``heads.layers.Attention.forward``."""
        bsz, q_len, _ = x.shape
        q = F.linear(x, *self.q).view(bsz, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, *self.k).view(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, *self.v).view(bsz, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        kv_len = k.shape[2]
        if mask is None and 1 < q_len != kv_len:
            mask = causal_mask(q_len, kv_len, q.dtype, q.device)
        elif mask is not None:
            if mask.shape[-2:] != (q_len, kv_len):
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected (B, 1, {q_len}, {kv_len})")
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q_len > 1,
                                             enable_gqa=self.kv_heads != self.heads)
        return F.linear(out.transpose(1, 2).reshape(bsz, q_len, -1), *self.o)


_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def lean_eagle3(head: nn.Module) -> LeanEagle3 | None:
    """``head``'s lean step when one can be built and, the first time for this head, it equals the forward's bit
    for bit (a 3-token step into a cache, then a 1-token step after it); None otherwise (the drafter runs the
    modules)."""
    try:
        lean = LeanEagle3(head)
    except NotLean:
        return None
    if head not in _CHECKED:
        try:
            _CHECKED[head] = _agrees(head, lean)
        except Exception:  # noqa: BLE001  (a head whose forward takes these arguments otherwise: the modules run)
            _CHECKED[head] = False
    return lean if _CHECKED[head] else None


def _agrees(head: nn.Module, lean: LeanEagle3) -> bool:
    weight = lean.q[0]
    width = head.config.hidden_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden, embeds = (torch.randn(1, 4, width, generator=gen).to(weight) for _ in range(2))
    positions = torch.arange(4, device=weight.device)[None]
    caches = HeadCache(), HeadCache()
    with torch.inference_mode():
        for part in (slice(0, 3), slice(3, 4)):
            args = (hidden[:, part], embeds[:, part], positions[:, part])
            ours = lean(*args, None, caches[0])
            theirs = head(*args, attention_mask=None, past_key_values=caches[1]).hidden_states
            if not torch.equal(ours, theirs):
                return False
    return True


__all__ = ["LeanEagle3", "lean_eagle3"]
