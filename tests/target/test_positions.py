"""Per-position states (target.positions, docs/hybrid.md "Per-position states"): the recording Gated DeltaNet rule is
transformers' per-token rule bit for bit, with the state after every token; the recording Mamba-2 scan gives the
chunked scan's outputs, and as states its end states of every prefix, which the one-token updates ``generate``
runs reach too; the cache keeps each row's
accepted position, refuses a layer that recorded nothing, and hands a call's states only to that call's final
state. End to end (greedy identity, batches, plants): tests/infer/test_infer_hybrid_rollback.py."""
from __future__ import annotations

import pytest
import torch

from draftsmith.target import positions
from draftsmith.target.recurrent import LinearAttentionLayer, LinearStates

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")


def _gdn_inputs(batch=2, length=6, k_heads=2, v_heads=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, length, k_heads, dim, generator=g) for _ in range(2))
    v = torch.randn(batch, length, v_heads, dim, generator=g)
    decay = -torch.rand(batch, length, v_heads, generator=g)
    beta = torch.rand(batch, length, v_heads, generator=g)
    state = torch.randn(batch, v_heads, dim, dim, generator=g)
    return q, k, v, decay, beta, state


def test_the_recording_delta_rule_is_transformers_per_token_rule_with_every_state():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as theirs
    q, k, v, decay, beta, state = _gdn_inputs()
    out, final, states = positions.recurrent_gated_delta_rule(q, k, v, decay, beta, state, True)
    ref_out, ref_final = theirs(q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
    assert states.shape == (2, 6, 4, 8, 8) and torch.equal(states[:, -1], final)
    for t in range(6):  # the state after token t: their rule run over the first t + 1 tokens
        _, prefix = theirs(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g=decay[:, : t + 1], beta=beta[:, : t + 1],
                           initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(states[:, t], prefix), t


def _scan_inputs(batch=2, length=5, heads=4, dim=3, groups=2, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, dim, generator=g)
    dt = torch.randn(batch, length, heads, generator=g)
    A = -torch.rand(heads, generator=g) * 2
    B = torch.randn(batch, length, groups, n, generator=g)
    C = torch.randn(batch, length, groups, n, generator=g)
    D, bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    state = torch.randn(batch, heads, dim, n, generator=g)
    return x, dt, A, B, C, D, bias, state


def test_the_recording_mamba2_scan_is_the_chunked_scan_and_the_one_token_updates_with_every_state():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan, mamba2_selective_state_update
    x, dt, A, B, C, D, bias, state = _scan_inputs()
    out, final, states = positions.mamba2_scan(x, dt, A, B, C, state, D, bias, True)
    assert states.shape == (2, 5, 4, 3, 6) and torch.equal(states[:, -1], final)
    ref_out, ref_final = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=5, D=D, dt_bias=bias, initial_states=state,
                                           dt_softplus=True, return_final_states=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-5)
    stepped = state.clone()
    heads, dim, n = 4, 3, 6
    for t in range(5):
        _, end = mamba2_chunk_scan(x[:, : t + 1], dt[:, : t + 1], A, B[:, : t + 1], C[:, : t + 1], chunk_size=t + 1,
                                   D=D, dt_bias=bias, initial_states=state, dt_softplus=True, return_final_states=True)
        torch.testing.assert_close(states[:, t], end, rtol=1e-5, atol=1e-5)
        y = mamba2_selective_state_update(  # what generate runs per token, as Bamba's one-token branch calls it
            stepped, x[:, t], dt[:, t, :, None].expand(-1, -1, dim), A[:, None, None].expand(-1, dim, n), B[:, t],
            C[:, t], D[:, None].expand(-1, dim), dt_bias=bias[:, None].expand(-1, dim), dt_softplus=True)
        torch.testing.assert_close(states[:, t], stepped, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[:, t], y, rtol=1e-5, atol=1e-5)


def test_a_call_hands_its_states_to_its_own_final_state_only():
    final, other, states = torch.zeros(1), torch.zeros(1), torch.ones(2, 3)
    assert not positions.on()
    with positions.recording():
        assert positions.on()
        positions.put(final, states)
        assert positions.take(other) is None  # another tensor (equal values): not that call's
        positions.put(final, states)
        assert positions.take(final) is states and positions.take(final) is None  # taken once
        positions.put(final, states)
    assert not positions.on() and positions.take(final) is None  # nothing outlives the verify


def _recorded_states(batch=3, channels=2, kernel=3, width=4, dim=2):
    """A LinearStates after a prefill, then a recorded verify of ``width`` tokens on one layer (conv inputs and
    recurrent states made up, distinct per row and position)."""
    states = LinearStates()
    states.update_conv_state(torch.zeros(batch, channels, kernel), 0, conv_kernel_size=kernel)  # the prefill
    states.update_recurrent_state(torch.zeros(batch, dim, dim), 0)
    old = states.get_conv_state(0).clone()
    inputs = torch.arange(batch * channels * width, dtype=torch.float32).view(batch, channels, width) + 1
    per_position = torch.arange(batch * width * dim * dim, dtype=torch.float32).view(batch, width, dim, dim) + 1
    with positions.recording():
        states.update_conv_state(inputs, 0)
        final = per_position[:, -1]
        positions.put(final, per_position)
        states.update_recurrent_state(final, 0)
    return states, torch.cat([old, inputs], dim=-1), per_position


def test_each_row_keeps_its_own_accepted_position():
    states, full, per_position = _recorded_states()
    after_verify = (states.get_conv_state(0).clone(), states.get_recurrent_state(0).clone())
    states.keep([2, 4, 0])  # row 0 keeps 2 of 4; row 1 all 4; row 2 had stopped
    conv, recurrent = states.get_conv_state(0), states.get_recurrent_state(0)
    assert torch.equal(conv[0], full[0, :, 2:5]) and torch.equal(recurrent[0], per_position[0, 1])
    assert torch.equal(conv[1:], after_verify[0][1:]) and torch.equal(recurrent[1:], after_verify[1][1:])
    assert states.recorded == {}
    for kept in ([3, 3, 3], [1, 3, 2]):  # every row the same count (one copy for the batch), or each its own
        states, full, per_position = _recorded_states()
        states.keep(kept)
        for b, k in enumerate(kept):
            assert torch.equal(states.get_conv_state(0)[b], full[b, :, k: k + 3]), (kept, b)
            assert torch.equal(states.get_recurrent_state(0)[b], per_position[b, k - 1]), (kept, b)


def test_a_layer_that_recorded_nothing_is_refused():
    states, _, _ = _recorded_states()
    del states.recorded[(0, "recurrent", 0)]
    with pytest.raises(RuntimeError, match="recurrent layer 0 recorded no recurrent state in the verify"):
        states.keep([2, 4, 0])
    fresh = LinearStates()
    fresh.update_conv_state(torch.zeros(1, 2, 3), 0, conv_kernel_size=3)
    fresh.update_recurrent_state(torch.zeros(1, 2, 2), 0)
    with positions.recording(), pytest.raises(RuntimeError, match="recurrent layer 0's rule kept no per-position"):
        fresh.update_recurrent_state(torch.ones(1, 2, 2), 0)  # a rule that put nothing: not routed
