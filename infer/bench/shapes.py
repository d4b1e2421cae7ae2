"""Randomly initialised targets of real model shapes (no download)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES = {
    # Llama-3.1-8B's published config.json (context cut to 8k: the buffer is what matters)
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                        max_position_embeddings=8192, rms_norm_eps=1e-5),
    # SmolLM2-135M-Instruct
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    # the demo target's dimensions (scripts/make_demo_target.py --size tiny)
    "demo-tiny": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=3,
                      num_key_value_heads=1, vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=2048),
    # for trying the script on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=2048),
}


def build_target(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A random-weight Llama of ``shape`` that always generates max_new_tokens (no EOS)."""
    import torch  # here, not at the top: scripts/bench_scale.py checks --shape against SHAPES before torch loads
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens
    model.generation_config.pad_token_id = 0
    return model
