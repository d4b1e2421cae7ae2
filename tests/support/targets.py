"""Tiny HF targets built in-process from configs (no downloads), and small helpers the tests share."""
from __future__ import annotations

import socket

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

ARCHES = ("llama", "qwen2", "qwen3", "mistral")


_CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def free_port() -> int:
    """A TCP port free right now, for a test's ``--main_process_port``: a fixed one would collide with the
    same test on another xdist worker or another checkout's suite on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_target(
    arch: str = "llama",
    *,
    vocab_size: int = 96,
    hidden_size: int = 32,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 256,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **extra,
):
    """A randomly initialised causal LM of the given family, in eval mode.

    ``num_layers`` defaults to 6 so EAGLE-3's default aux layers [2, L//2, L-3] = [2, 3, 3]
    are valid; pass ``num_layers=8`` for three distinct ones.
    """
    cls = _CONFIGS[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden_size // num_heads
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    config = cls(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.to(dtype).eval()


def make_successor_target(vocab_size: int = 96):
    """A tiny Llama whose greedy continuation is mostly learnable: its lm_head maps each token's
    embedding to a fixed successor, and attention and MLP stay as a small perturbation."""
    model = make_tiny_target("llama", vocab_size=vocab_size, initializer_range=0.3)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))
        embed = model.get_input_embeddings().weight
        model.get_output_embeddings().weight.copy_(embed[torch.argsort(successor)])  # logit of succ(t) ~ |e_t|^2
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    return model


def has_cuda() -> bool:
    return torch.cuda.is_available()


def record_drafts(drafter) -> list:
    """Every draft ``drafter`` proposes from now on, as the generator asks for them (``propose_rows``:
    every row of a step at once), appended to the returned list."""
    drafts, propose_rows = [], drafter.propose_rows

    def recording(*args, **kwargs):
        out = propose_rows(*args, **kwargs)
        drafts.extend(out)
        return out

    drafter.propose_rows = recording
    return drafts
