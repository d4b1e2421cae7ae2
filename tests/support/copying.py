"""A target that repeats itself and an EAGLE-3 head that copies it: decode τ's tests (greedy and sampled) need
drafts that are accepted for a while and then are not."""
from __future__ import annotations

import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head


def repeating_target(eos: int | None = None):
    """A tiny Llama with tied embeddings whose last two layers pass the residual through unchanged (the state
    entering layer 4 is the final one) and whose first four write 3x their random outputs: its greedy text
    repeats a token for a while, then moves on (a copying head's accepted runs vary)."""
    target = make_tiny_target("llama", vocab_size=96, num_layers=6, tie_word_embeddings=True)
    with torch.no_grad():
        for i, layer in enumerate(target.model.layers):
            layer.self_attn.o_proj.weight.mul_(3.0 if i < 4 else 0.0)
            layer.mlp.down_proj.weight.mul_(3.0 if i < 4 else 0.0)
    target.generation_config.eos_token_id = eos
    return target


def copying_eagle3(target, **options):
    """An EAGLE-3 head that drafts the token it reads again and again: fc keeps the aux layer 4 state (the
    target's final one), the decoder layer adds nothing, norm and lm_head are the target's. Its chains are
    accepted while the target repeats a token (at T = 1 too: it drafts the target's own law there)."""
    head = build_head("eagle3", target, aux_layer_ids=[1, 2, 4], **options).eval()
    width = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * width:] = torch.eye(width)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
    return head
