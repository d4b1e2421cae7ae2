"""The masked forward of the decode step: per-row masks, positions and slots on fixed shapes
(``SpeculativeGenerator`` runs one loop for B >= 1 rows).

Per-row state on fixed shapes (the vLLM/SGLang way):
- the target's ``StaticKVCache`` holds (B, ..., max_len) slots; the prompt fills slots [0, P) of every
  row (left padding first), and row b's accepted tokens follow at its own length ``lengths[b]``;
- positions come from ``attention_mask.cumsum - 1`` for the prompt and from each row's own counter
  after it (``lengths - pads``);
- one [B, N] verify per step: every row's draft padded to N nodes with dummy nodes no real node sees
  (``infer.tree.pad_tree``), written at the row's own slots (a scatter, ``StaticKVCache.update``),
  under a per-row additive mask (``verify_mask``: the row's left-pad columns blocked, its valid
  prefix visible, its tree after it);
- a target with sliding-window layers gets, beside that mask, the same mask with every key more than
  ``window - 1`` positions behind its query blocked (``attention_masks``): a dict per layer type where
  the model mixes sliding and full layers, the windowed mask alone where every layer slides; the cache
  keeps every entry, so nothing is evicted and generation runs past the window;
- accepted paths are compacted for every row at once (``StaticKVCache.compact_rows``, one
  fixed-size gather); rejected slots are simply overwritten by the next verify.

The drafter gets every live row at once (``Drafter.observe_rows`` / ``propose_rows``): the heads draft
all rows in one pass over a head cache with a row each; other drafters draft row by row.
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from draftsmith.heads.layers import additive_mask
from draftsmith.infer.cache import StaticKVCache
from draftsmith.target.cache_keywords import cache_kwargs
from draftsmith.target.lean_forward import LeanStack
from draftsmith.target.lean_hybrid import HybridStack
from draftsmith.target.recurrent import RECURRENT_MASK_KEYS, is_hybrid
from draftsmith.target.model import TargetOutput, backbone_of, causal_lm_of


def masked_forward(model: nn.Module, input_ids: Tensor, slots: Tensor, mask: Tensor | dict[str, Tensor],
                   positions: Tensor, cache: StaticKVCache, aux_layer_ids: tuple[int, ...] = (),
                   inputs_embeds: Tensor | None = None, lean: LeanStack | HybridStack | None = None) -> TargetOutput:
    """One target forward over ``cache`` for a batch: input_ids (B, T) written at ``slots`` ((T,)
    shared, or (B, T) per row), under the additive ``mask`` (B, 1, T, cache.attended) at
    ``positions`` (B, T); a dict of such masks per layer type for a target that mixes sliding and
    full layers (``attention_masks``). ``inputs_embeds`` (B, T, H) replaces the tokens' embeddings
    (a view of the target's later layers fed the states entering them: ``Drafter.entry_model``). ``lean``: the
    target's ``target.lean`` stack, the same ops without (most of) the module machinery (not with
    ``inputs_embeds``)."""
    cache.slots = slots
    if lean is not None and inputs_embeds is None:
        final_hidden, aux = lean(input_ids, mask, positions, cache, aux_layer_ids)
        logits = causal_lm_of(model).get_output_embeddings()(final_hidden)
        return TargetOutput(logits=logits, final_hidden=final_hidden, aux_hidden=aux, past_key_values=cache)
    backbone = backbone_of(model)
    out = backbone(input_ids=None if inputs_embeds is not None else input_ids, inputs_embeds=inputs_embeds,
                   attention_mask=mask, position_ids=positions, use_cache=True, **cache_kwargs(backbone, cache),
                   output_hidden_states=bool(aux_layer_ids))
    final_hidden = out.last_hidden_state
    aux = torch.cat([out.hidden_states[k] for k in aux_layer_ids], dim=-1) if aux_layer_ids else None
    logits = causal_lm_of(model).get_output_embeddings()(final_hidden)
    return TargetOutput(logits=logits, final_hidden=final_hidden, aux_hidden=aux, past_key_values=cache)


def prefill_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, 1, P, P) additive mask of a left-padded prompt: causal over each row's real tokens; a pad
    query sees itself only (its output is never read)."""
    p = attention_mask.shape[1]
    causal = torch.ones(p, p, dtype=torch.bool, device=attention_mask.device).tril_()
    allowed = (causal[None] & attention_mask.bool()[:, None, :]) | torch.eye(p, dtype=torch.bool,
                                                                              device=attention_mask.device)
    return additive_mask(allowed, dtype)[0, 0][:, None]


def verify_mask(lengths: Tensor, pads: Tensor, blocks: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """(B, 1, N, width) additive mask of a [B, N] verify: row b's queries see its slots [pads[b],
    lengths[b]) and, among the N slots written at lengths[b], those ``blocks[b]`` (N, N) allows."""
    n = blocks.shape[-1]
    col = torch.arange(width, device=lengths.device)[None]  # (1, W)
    rel = col - lengths[:, None]  # (B, W) slot relative to the row's first new slot
    prefix = (col >= pads[:, None]) & (rel < 0)  # (B, W)
    inside = (rel >= 0) & (rel < n)
    tree = blocks.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(-1, n, -1)) & inside[:, None, :]  # (B, N, W)
    return additive_mask(prefix[:, None, :] | tree, dtype)[0, 0][:, None]


def sliding_window(config) -> int | None:
    """The sliding window the target's attention really uses (HF's rule: a query at position q sees
    keys at k > q - window), or None when every layer attends to the whole context."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return None if getattr(config, "use_sliding_window", True) is False else window


def verify_key_positions(lengths: Tensor, pads: Tensor, positions: Tensor, width: int) -> Tensor:
    """(B, width) the position of the entry in each slot a [B, N] verify attends: ``slot - pads[b]``
    in row b's prefix, the new nodes' own ``positions`` (B, N) from ``lengths[b]`` on."""
    col = torch.arange(width, device=lengths.device)[None]
    rel = col - lengths[:, None]
    return torch.where(rel < 0, col - pads[:, None], positions.gather(1, rel.clamp(0, positions.shape[1] - 1)))


def attention_masks(config, mask: Tensor, query_positions: Tensor, key_positions: Tensor,
                    padding: Tensor | None = None) -> Tensor | dict[str, Tensor | None]:
    """What the target's layers take for the additive ``mask`` (B, 1, T, W) whose queries sit at
    ``query_positions`` (B, T) and keys at ``key_positions`` (B, W): ``mask`` itself without sliding
    layers; with them, the same mask with keys ``window`` or more positions behind the query blocked,
    per layer type (``{"full_attention": ..., "sliding_attention": ...}``) where the model has layer
    types, alone where every layer slides (Mistral). A query always sees itself: no row is empty.

    A hybrid target (``target.recurrent``) gets the dict in every case, its recurrent layers' entries
    (``linear_attention``, ``conv``) the (B, T) ``padding`` mask of the new tokens (1 = token, 0 = left
    pad, whose input HF's recurrent layers zero so it never enters a row's state) or None without pads."""
    window = sliding_window(config)
    windowed = mask
    if window is not None:
        far = (query_positions[:, :, None] - key_positions[:, None, :]) >= window  # (B, T, W)
        windowed = mask.masked_fill(far[:, None], torch.finfo(mask.dtype).min)
    if is_hybrid(config):
        return {"full_attention": mask, "sliding_attention": windowed, **dict.fromkeys(RECURRENT_MASK_KEYS, padding)}
    if window is None:
        return mask
    if getattr(config, "layer_types", None) is None:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


__all__ = ["attention_masks", "masked_forward", "prefill_mask", "sliding_window", "verify_key_positions",
           "verify_mask"]
