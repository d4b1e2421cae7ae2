"""The tests' one HF reference: the target's own greedy ``generate``, which every lossless claim is checked
against. It always passes the attention mask (all ones unless given: without one, HF masks every context
token equal to the pad id) and the pad id."""
from __future__ import annotations

import torch

_DECODED: dict[tuple, tuple] = {}


def hf_greedy(model, ids: torch.Tensor, max_new: int, eos=None, *, mask: torch.Tensor | None = None, pad: int = 0,
              once: bool = False) -> torch.Tensor:
    """``model.generate`` of ``ids`` (B, P), greedy, ``max_new`` new tokens, stopping at ``eos`` (None: the model's
    generation config's, as ``SpeculativeGenerator.generate`` does; an explicit ``eos_token_id=None`` would
    switch HF's off), with ``mask`` (left padding) or all ones. ``once``: computed once per (model, prompt,
    max_new, eos) in a process (the head kinds of a family decode the same prompts, and HF's references were
    ~40% of an eager greedy case)."""
    if not once:
        stop = {} if eos is None else {"eos_token_id": eos}
        return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, do_sample=False,
                              max_new_tokens=max_new, pad_token_id=pad, **stop)
    key = (id(model), tuple(ids.flatten().tolist()), ids.shape, None if mask is None else tuple(mask.flatten().tolist()),
           max_new, str(eos), pad)
    if key not in _DECODED:
        _DECODED[key] = (model, hf_greedy(model, ids, max_new, eos, mask=mask, pad=pad))  # the model kept: its id stays its own
    return _DECODED[key][1]
