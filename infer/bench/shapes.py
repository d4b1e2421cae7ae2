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
    # Qwen3-8B's published config.json (q/k norms, head_dim 128; context cut to 8k)
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-6),
    # Qwen3.5's text model as transformers' Qwen3_5TextConfig defaults it (hidden 4096, 32 layers: Gated DeltaNet
    # x3 + gated attention, vocab 248,320): the 9B's language model, a hybrid (target.recurrent)
    "qwen3.5-9b": dict(model_type="qwen3_5_text", max_position_embeddings=8192),
    # for trying the script on a CPU
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                       tie_word_embeddings=False, max_position_embeddings=2048),
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                         max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=2048),
}


def build_target(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A random-weight model of ``shape`` (a Llama unless the shape names a ``model_type``) that always
    generates max_new_tokens (no EOS)."""
    import torch  # here, not at the top: scripts/bench_scale.py checks --shape against SHAPES before torch loads
    from transformers import AutoConfig, AutoModelForCausalLM

    options = dict(SHAPES[shape])
    config = AutoConfig.for_model(options.pop("model_type", "llama"), **options, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens
    model.generation_config.pad_token_id = 0
    return model
