"""target.model: feature capture matches HF output_hidden_states on stock models."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.target.model import decoder_layers, target_forward, loaded_target_identity


def test_matches_output_hidden_states(arch):
    model = make_tiny_target(arch, num_layers=8)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = model(ids, output_hidden_states=True)
    aux_ids = (2, 4, 5)
    with torch.no_grad():
        out = target_forward(model, ids, aux_layer_ids=aux_ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    # hidden_states[-1] is the post-final-norm state (the lm_head input).
    torch.testing.assert_close(out.final_hidden, ref.hidden_states[-1], rtol=0, atol=0)
    expected = torch.cat([ref.hidden_states[k] for k in aux_ids], dim=-1)
    torch.testing.assert_close(out.aux_hidden, expected, rtol=0, atol=0)
    assert out.aux_hidden.shape == (2, 9, 3 * model.config.hidden_size)
    # Hooks are removed afterwards.
    assert all(not layer._forward_pre_hooks for layer in decoder_layers(model))


def test_aux_order_is_as_given_and_embeddings_index_zero():
    model = make_tiny_target("qwen2")
    ids = torch.randint(3, 96, (1, 5))
    ref = model(ids, output_hidden_states=True).hidden_states
    with torch.no_grad():
        out = target_forward(model, ids, aux_layer_ids=(3, 0), compute_logits=False)
    h = model.config.hidden_size
    torch.testing.assert_close(out.aux_hidden[..., :h], ref[3], rtol=0, atol=0)
    torch.testing.assert_close(out.aux_hidden[..., h:], model.model.embed_tokens(ids), rtol=0, atol=0)
    assert out.logits is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cache_and_4d_float_mask(attn):
    """Prefix with cache, then a continuation under an explicit 4D causal float mask."""
    model = make_tiny_target("llama", attn_implementation=attn)
    ids = torch.randint(3, 96, (1, 10))
    with torch.no_grad():
        full = target_forward(model, ids, aux_layer_ids=(1,))
        pre = target_forward(model, ids[:, :6], aux_layer_ids=(1,), use_cache=True)
        blocked = torch.finfo(model.dtype).min
        mask = torch.full((1, 1, 4, 10), blocked).triu(7)  # row i sees columns 0..6+i
        mask = torch.where(mask == 0, 0.0, blocked)
        rest = target_forward(
            model,
            ids[:, 6:],
            aux_layer_ids=(1,),
            attention_mask=mask,
            position_ids=torch.arange(6, 10)[None],
            past_key_values=pre.past_key_values,
            use_cache=True,
        )
    torch.testing.assert_close(rest.logits, full.logits[:, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest.aux_hidden, full.aux_hidden[:, 6:], rtol=1e-5, atol=1e-5)
    assert rest.past_key_values.get_seq_length() == 10


def test_bad_layer_id_and_identity():
    model = make_tiny_target("mistral")
    with pytest.raises(ValueError, match="out of range"):
        target_forward(model, torch.tensor([[3, 4]]), aux_layer_ids=(6,))
    ident = loaded_target_identity(model)
    assert ident["architecture"] == "MistralForCausalLM"
    assert ident["model_type"] == "mistral"
    assert (ident["hidden_size"], ident["num_layers"], ident["vocab_size"]) == (32, 6, 96)
    assert ident["max_position_embeddings"] == 256
    with pytest.raises(ValueError, match="decoder"):
        decoder_layers(torch.nn.Linear(2, 2))
