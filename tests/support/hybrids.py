"""Tiny hybrid targets (recurrent or convolution layers beside attention) built in-process from
transformers' own configs: every hybrid family transformers 5.24 can build tiny on CPU and draftsmith
supports (target.recurrent.LAYER_KINDS; the refused ones are in tests/target/test_hybrid_refusals.py)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, head_dim=8)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
               mamba_chunk_size=16)  # 4 heads x 16 = 2 x hidden 32

_LINEAR_FULL = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
_KDA = dict(num_experts=4, num_experts_per_token=2, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=4,
            v_head_dim=8, qk_nope_head_dim=8, linear_head_dim=8, linear_num_heads=4, head_dim=8,
            num_key_value_heads=4)  # Kimi Delta Attention beside multi-head latent attention (MLA)

# model_type -> (config overrides); each has at least one attention layer and one recurrent layer
HYBRIDS: dict[str, dict] = {
    "qwen3_5_text": dict(num_hidden_layers=4, **_GDN),  # Qwen3.5 / 3.6: Gated DeltaNet x3 + gated attention
    "qwen3_next": dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, **_GDN),
    "lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                 block_ff_dim=64, conv_L_cache=3),  # LFM2: short causal conv + attention
    "nemotron_h": dict(num_hidden_layers=4, layers_block_type=["mamba", "attention", "mlp", "mamba"],
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, conv_kernel=4,
                       chunk_size=16, head_dim=8, time_step_min=0.01),  # Nemotron-H: Mamba-2 / attention / MLP
    "falcon_h1": dict(num_hidden_layers=3, head_dim=8, mamba_d_ssm=64, **_MAMBA2),  # Mamba-2 beside attention, per layer
    "bamba": dict(num_hidden_layers=4, attn_layer_indices=[1], **_MAMBA2),  # Bamba: Mamba-2 + attention
    "granitemoehybrid": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                               "linear_attention"], num_local_experts=4,
                             shared_intermediate_size=32, **_MAMBA2),  # Granite-4.0-H
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, num_experts=4, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),  # Mamba-1 + MoE
    "olmo_hybrid": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                          "linear_attention"], num_key_value_heads=4,
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4),
    "lara_mini": dict(num_hidden_layers=4, layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                                         "full_attention"], sliding_window=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      **_GDN),  # Gated DeltaNet + sliding and full attention + MoE
    "qwen3_5_moe_text": dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, **_GDN),  # Qwen3.5-MoE's language model
    "lfm2_moe": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"],
                     num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     conv_L_cache=3),  # LFM2-MoE: short conv + attention, MoE past the first layer
    "lfm3": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "sliding_attention"],
                 head_dim=8, sliding_window=8, conv_L_cache=3),  # short conv + full and sliding attention
    "kimi_linear": dict(num_hidden_layers=4, layer_types=_LINEAR_FULL, mlp_layer_types=["dense", "sparse"] * 2,
                        **_KDA),  # Kimi Delta Attention + MLA (its cache holds the compressed latents)
    "bailing_hybrid": dict(num_hidden_layers=4, layer_types=_LINEAR_FULL, mlp_layer_types=["dense", "sparse"] * 2,
                           num_expert_group=1, topk_group=1, first_k_dense_replace=1, **_KDA),  # Ling-3.0
    "zamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, attention_head_dim=16,
                  attention_hidden_size=64, n_mamba_heads=2, mamba_d_state=8, mamba_dt_rank=8,
                  num_key_value_heads=4),  # Mamba-1, a shared attention block in its "hybrid" layers
    "zamba2": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid", "linear_attention",
                                                           "linear_attention"], mamba_d_state=8, n_mamba_heads=4,
                   mamba_headdim=16, chunk_size=16, num_key_value_heads=4, adapter_rank=8,
                   time_step_min=0.01),  # Mamba-2 + shared block
}


# Nemotron-H's and Zamba2's time_step_min is 0.01 (default 0.001): their Mamba-2 mixers clamp dt at it in the chunked
# scan only, not in the one-token update generate runs (target/one_token.py); at 0.001 about 0.8% of these tiny models'
# dt reach the clamp, at 0.01 about 5%, enough that a verify through the clamp differs from generate on 3 of 20
# prompts (tests/target/test_hybrid_exact.py, test_mamba2_families_decode_like_generate).

# What makes a tiny random model's text depend on its recurrent and conv states (tests/infer/test_infer_hybrid_power.py
# asserts it per family): weights of std 0.1 (the default 0.02 leaves the mixers' outputs negligible), conv
# kernels x10 (the window matters), and a slow decay, A_log = -3 (A = -0.05: the default init forgets in a
# few tokens, so a lost state would not show).
STATE_SENSITIVE = dict(initializer_range=0.1, conv_scale=10.0, a_log=-3.0)


def make_tiny_hybrid(model_type: str, *, seed: int = 0, num_layers: int | None = None, sharpen: float = 1.0,
                     vocab: int = 96, state_sensitive: bool = True, **config):
    """A randomly initialised tiny fp32 hybrid causal LM, in eval mode (sdpa attention), whose greedy text
    depends on its recurrent and conv states (``STATE_SENSITIVE``; False: transformers' default init).

    ``sharpen`` scales the lm_head so greedy choices are clear (no near-ties between the
    multi-token and one-token kernels' arithmetic); ``config``: more config fields (over ``HYBRIDS``')."""
    options = {**_COMMON, **HYBRIDS[model_type], "vocab_size": vocab, **config}
    if state_sensitive:
        options["initializer_range"] = STATE_SENSITIVE["initializer_range"]
    if num_layers is not None:
        options["num_hidden_layers"] = num_layers
        for key in ("layer_types", "layers_block_type"):
            if key in options:
                options[key] = options[key][:num_layers]
    config = AutoConfig.for_model(model_type, **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        if state_sensitive:
            for name, param in model.named_parameters():
                if name.endswith("A_log"):
                    param.fill_(STATE_SENSITIVE["a_log"])
            for module in model.modules():
                if isinstance(module, torch.nn.Conv1d):
                    module.weight.mul_(STATE_SENSITIVE["conv_scale"])
        if sharpen != 1.0:
            model.get_output_embeddings().weight.mul_(sharpen)
    return model

