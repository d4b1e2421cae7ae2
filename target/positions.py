"""Every verified position's recurrent state, so that a hybrid's rollback keeps the accepted one instead of running
tokens again (docs/hybrid.md, "Per-position states").

A verify over T tokens leaves each recurrent layer's state after all T; a partial accept wants the state after the
first a. transformers' rules return only the last state, so draftsmith's other rollbacks restore a checkpoint and run
the accepted tokens again (``infer.rollback``'s "merged" and "replay"). Inside ``recording()``, the verify keeps every
position's state instead, as vLLM's and SGLang's speculative decoding on Mamba hybrids do:

- the conv window: ``LinearStates.update_conv_state`` already receives the verify's inputs behind the old window
  (transformers' layers concatenate them to convolve), so the window after a tokens is a slice of that concatenation;
- the recurrent matrix: the generator's router (``target.delta_rule``) runs the layer's rule here and ``put``s the
  states after each token, keyed by the final state it returns; the cache ``take``s them when the layer hands it
  that final state (``update_recurrent_state``). A call that put none is a layer whose rule is not routed: the
  cache raises (``LinearStates``), never keeps a wrong state.

Two rules record: Gated DeltaNet's per-token rule, ``recurrent_gated_delta_rule``, transformers'
``torch_recurrent_gated_delta_rule`` with every state kept (the same operations in the same order: bit for bit its
outputs and final state, ``tests/target/test_positions.py``), and Mamba-2's chunked scan, ``mamba2_scan``: the
scan's algebra over one chunk of the call's T tokens, every prefix's end state kept (equal to transformers' scan
and to the one-token updates ``generate`` runs up to fp32 rounding, tested there). It replaces the scan in a
recorded verify rather than running beside it: the scan and the states would cost 1.5 times the states alone.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

_local = threading.local()


@contextmanager
def recording():
    """Inside (the generator's verify forward, when its rollback is "recorded"): routed rules keep every position's
    state and the cache keeps the verify's conv inputs."""
    _local.on, _local.last = True, None
    try:
        yield
    finally:
        _local.on, _local.last = False, None


def on() -> bool:
    """Whether a verify is recording now (in this thread)."""
    return getattr(_local, "on", False)


def put(final: Tensor, states: Tensor) -> None:
    """A routed rule's per-position ``states`` (B, T, ...) of the call whose final state is ``final``."""
    _local.last = (final, states)


def take(final: Tensor) -> Tensor | None:
    """The per-position states of the call that returned ``final`` (None: that call recorded none)."""
    last = getattr(_local, "last", None)
    _local.last = None
    return last[1] if last is not None and last[0] is final else None


def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """transformers' Gated DeltaNet ``l2norm`` (the same operations)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def recurrent_gated_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor, use_qk_l2norm_in_kernel: bool = False,
                               **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' ``torch_recurrent_gated_delta_rule`` (5.17 and 5.24: a loop over the tokens), returning the
    state after every token too: (outputs (B, T, H_v, d_v), final state (B, H_v, d_k, d_v), states (B, T, H_v, d_k,
    d_v)). query and key (B, T, H_k, d_k), value (B, T, H_v, d_v), g and beta (B, T, H_v)."""
    dtype = query.dtype
    k_heads = key.shape[2]
    v_heads = value.shape[-2]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    query = (query / (query.shape[-1] ** 0.5)).unsqueeze(-1)  # (B, H, T, d_k, 1)
    key, beta = key.unsqueeze(-1), beta.unsqueeze(-1)  # views, hoisted; every arithmetic op as their loop runs it
    state = initial_state.to(value)
    outs, states = [], []
    # each token's slices taken at once (views of the same values: the arithmetic below is theirs, op for op)
    for g_i, k_i, v_i, b_i, q_i in zip(*(x.unbind(2) for x in (g, key, value, beta, query))):
        # exp per token, as theirs: one vectorised exp over every token may round otherwise on another CPU's kernels
        state = state * g_i.exp()[..., None, None]
        delta = (v_i - (state * k_i).sum(dim=-2)) * b_i
        state = state + k_i * delta.unsqueeze(-2)
        outs.append((state * q_i).sum(dim=-2))
        states.append(state)
    out = torch.stack(outs, dim=1)  # (B, T, H, d_v)
    return out.to(dtype), state, torch.stack(states, dim=1)


def mamba2_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, initial_states: Tensor,
                D: Tensor | None = None, dt_bias: Tensor | None = None, dt_softplus: bool = False,
                dt_limit: tuple[float, float] = (0.0, float("inf"))) -> tuple[Tensor, Tensor, Tensor]:
    """A stateful Mamba-2 chunked scan's call over T tokens as one chunk, keeping the state after every token:
    (outputs (B, T, H, P) in fp32 as the scan's, final state (B, H, P, N), states (B, T, H, P, N)). hidden_states
    (B, T, H, P), dt (B, T, H), A (H,), B and C (B, T, G, N), initial_states (B, H, P, N). The state after token t
    is exp(Σ_{u<=t} A·dt_u)·S_0 + Σ_{s<=t} exp(Σ_{s<u<=t} A·dt_u)·dt_s·x_s ⊗ B_s and the output C_t·S_t + D·x_t:
    the scan's algebra over one chunk (its steps 1-4), every prefix's end state kept instead of the last one's."""
    batch, length, heads, dim = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    B, C = (m.float().repeat_interleave(heads // m.shape[2], dim=2, output_size=heads).transpose(1, 2)
            for m in (B, C))  # (B, H, T, N)
    cum = torch.cumsum((A.float() * dt).transpose(1, 2), dim=-1)  # (B, H, T)
    causal = torch.ones(length, length, dtype=torch.bool, device=cum.device).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))  # (B, H, t, s)
    inputs = ((x * dt[..., None]).transpose(1, 2).unsqueeze(-1) * B.unsqueeze(-2)).flatten(-2)  # (B, H, s, P·N)
    start = torch.exp(cum)[..., None] * initial_states.float().flatten(-2)[:, :, None]  # S_0 decayed to each t
    states = torch.matmul(decay, inputs).add_(start)
    states = states.view(batch, heads, length, dim, -1)  # (B, H, T, P, N)
    out = (states * C.unsqueeze(-2)).sum(-1).transpose(1, 2)  # (B, T, H, P)
    if D is not None:
        out = out + D.float()[:, None] * x
    states = states.transpose(1, 2)  # (B, T, H, P, N), a view
    return out.contiguous(), states[:, -1], states  # contiguous: Falcon-H1's mixer views the output


__all__ = ["mamba2_scan", "on", "put", "recording", "recurrent_gated_delta_rule", "take"]
