"""The checks of a ``SpeculativeGenerator.generate`` call's arguments, each refusal one line naming the value,
and the ids they resolve to (stop ids, pad id) as HF's ``generate`` resolves them."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.heads.common import text_config
from draftsmith.infer.accept import check_sampling_params
from draftsmith.infer.drafters import Sampling


def check_call(target: nn.Module, input_ids: Tensor, max_new_tokens: int, sampling: Sampling) -> None:
    """The prompts (B, P) ids inside the target's vocabulary, the budget an int >= 1, both within its context."""
    check_sampling_params(sampling.temperature, sampling.top_k, sampling.top_p)
    if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise ValueError("input_ids must be a LongTensor of shape (batch, prompt_len)")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has batch size 0: pass at least one prompt")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: pass at least one token (e.g. BOS)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    config = text_config(target)
    vocab = config.vocab_size
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:  # sync
        raise ValueError(f"input_ids contain ids outside the target's vocabulary [0, {vocab})")
    total = input_ids.shape[1] + max_new_tokens
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and input_ids.shape[1] >= context:
        raise ValueError(f"the prompt has {input_ids.shape[1]} tokens; the target's context is {context}")
    if context is not None and total > context:
        raise ValueError(
            f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"target's context of {context} tokens"
        )


def batch_mask(input_ids: Tensor, attention_mask: Tensor | None, streamer: Any, device: torch.device) -> Tensor:
    """The batch's (B, P) attention mask on ``device`` (ones when None), checked to be left padding."""
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError(f"streamer needs batch size 1 (as HF's streamers), got {input_ids.shape[0]}")
    if attention_mask is None:
        return torch.ones_like(input_ids, device=device)
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {shape}")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):  # sync; before .long() turns 0.5 into a pad
        odd = attention_mask[(attention_mask != 0) & (attention_mask != 1)][0].item()
        raise ValueError(f"attention_mask must hold 0 (pad) and 1 (token) only, got {odd!r}")
    mask = attention_mask.to(device).long()
    if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask[:, -1] == 0).any()):  # sync
        raise ValueError("attention_mask is not left-padded: pad every row on the left "
                         "(tokenizer.padding_side='left'), its last column holding a real token")
    return mask


def pad_id(target: nn.Module, pad_token_id: int | None, eos: Tensor) -> int:
    """The id after a row's end: ``pad_token_id``, else the target's generation config's, else the first EOS,
    else 0."""
    if pad_token_id is None:
        pad_token_id = getattr(getattr(target, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None:
        pad_token_id = int(eos[0]) if eos.numel() else 0
    return int(pad_token_id)


def eos_ids(target: nn.Module, eos_token_id: int | list[int] | None, device: torch.device) -> Tensor:
    """The (E,) stop ids on ``device``; None: the target's generation config decides, as in HF's ``generate``."""
    if eos_token_id is None:
        gen_config = getattr(target, "generation_config", None)
        eos_token_id = getattr(gen_config, "eos_token_id", None)
    if isinstance(eos_token_id, Tensor):
        eos_token_id = eos_token_id.tolist()
    ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    vocab = text_config(target).vocab_size
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them in [0, {vocab}), got {eos_token_id!r}")
    return torch.tensor(list(ids), dtype=torch.long, device=device)


__all__ = ["batch_mask", "check_call", "eos_ids", "pad_id"]
