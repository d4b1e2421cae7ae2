"""Self-speculation by layer skip (training-free): the target's own first ``k`` decoder layers, its
final norm and its lm_head draft a chain, so no second model sits in memory.

``early_exit_view(target, k)`` (target/views.py) is a view of the target that stops after layer ``k``: a shallow copy
whose module tree holds the target's own layer objects (nothing is copied or trained). A draft model
is anything ``LMDrafter`` drafts with, so ``LayerSkipDrafter`` is an ``LMDrafter`` over that view, with
its own KV cache of the first ``k`` layers. Verification stays the full target's, so decoding is as
lossless as with any drafter. ``k`` trades acceptance (more layers draft better) against cost (each
draft token costs k/L of a target forward on CPU): ``scripts/calibrate_layer_skip.py`` measures every
``k`` on held-out prompts and writes the fastest to a calibration file in the cache
(``calibration_path``: keyed by the target's identity, device type and dtype), where
``LayerSkipDrafter(target)`` (``k=None``) finds it; without one, ``default_layers``.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.data.base.paths import cache_root
from draftsmith.heads.common import final_norm_name
from draftsmith.heads.layers import additive_mask
from draftsmith.infer.masked_forward import attention_masks
from draftsmith.target.recurrent import model_type
from draftsmith.infer.drafters.base import Chain, Draft, Sampling, chain_buffers
from draftsmith.infer.drafters.free.lm_drafter import LMDrafter, LMState
from draftsmith.target.cache_keywords import cache_kwargs
from draftsmith.target.model import backbone_of, causal_lm_of, decoder_layers, loaded_target_identity
from draftsmith.target.views import early_exit_view, late_view, shallow_backbone

CALIBRATION_DIR = "layer-skip"  # under the cache root: one JSON per (target, device type, dtype)


def default_layers(target: nn.Module) -> int:
    """Half the target's layers (rounded up): where LayerSkip-style self-speculation usually starts;
    measure others with ``scripts/benchmark.py --layer-skip``."""
    return (len(decoder_layers(target)) + 1) // 2


def calibration_key(target: nn.Module) -> dict:
    """What a layer-skip calibration depends on: the target's identity, its device type and dtype."""
    weight = target.get_output_embeddings().weight
    return {**loaded_target_identity(target), "device": weight.device.type, "dtype": str(weight.dtype)}


def calibration_path(target: nn.Module) -> Path:
    """``<cache>/layer-skip/<model name>-<hash of calibration_key>.json``."""
    key = calibration_key(target)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(key["name_or_path"] or "target").name)
    return cache_root() / CALIBRATION_DIR / f"{name}-{digest}.json"


def calibrated_layers(target: nn.Module) -> int | None:
    """The ``k`` a calibration chose for this target, device and dtype; None when none was run."""
    path = calibration_path(target)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not a layer-skip calibration ({err}); run scripts/calibrate_layer_skip.py "
                         "again (it rewrites the file)") from None
    k = record.get("best_layers") if isinstance(record, dict) else None
    if not isinstance(k, int) or not 1 <= k < len(decoder_layers(target)):
        raise ValueError(f"{path}: best_layers={k!r} is not a layer count of this {len(decoder_layers(target))}-layer "
                         "target; run scripts/calibrate_layer_skip.py again (it rewrites the file)")
    return k


@dataclass
class LayerSkipState(LMState):
    row: int = 0  # this row's index in the target's cache (a batch's rows)


class LayerSkipDrafter(LMDrafter):
    """Draft a chain with the target's first ``k`` layers (``k=None``: the calibrated ``k``, else
    ``default_layers``; ``calibrated`` says which).

    Eager generation shares the first ``k`` layers' KV with the verify (LayerSkip's cache reuse,
    arXiv 2404.16710): every row's draft runs those layers over the target's own cache, writing each
    node's KV (root included, and the last draft too) at the slots the verify puts it, and keeps the
    state entering layer ``k`` (``Draft.entry``); the verify then runs layers ``k``.. only
    (``entry_model``). Every row drafts in one forward per level; nothing is kept between steps (the
    accepted nodes' KV is the target's). A compiled verify, or ``confidence``, drafts with the view's
    own cache and the verify runs every layer."""

    checks_draft_model = False  # a view of the target's first layers (LMDrafter.checks_draft_model)

    def __init__(self, target: nn.Module, k: int | None = None, tree: Chain | None = None,
                 confidence: float | None = None) -> None:
        if model_type(target) == "zamba":  # measured: tests/infer/test_infer_hybrid.py
            raise ValueError("ZambaForCausalLM (zamba): layer skip is refused: its drafts through the shared first "
                             "layers leave the output different from the target's own generate (not found why yet)")
        found = calibrated_layers(target) if k is None else None
        self.calibrated = found is not None
        self.layers = k if k is not None else found or default_layers(target)
        super().__init__(early_exit_view(target, self.layers), target, tree, confidence)
        self._shallow = shallow_backbone(target, self.layers)  # states entering layer k
        self._norm = getattr(backbone_of(target), final_norm_name(backbone_of(target)) or "norm")
        self._lm_head = causal_lm_of(target).get_output_embeddings()
        self._config = causal_lm_of(target).config.get_text_config()
        self.entry_model = late_view(target, self.layers) if self.confidence is None else None
        self._step: tuple | None = None  # (cache, lengths, pads) of this step, from before_draft
        self._compiled = False

    def new_rows(self, prompts: list[Tensor], lengths: list[int]) -> list[LayerSkipState]:
        return [LayerSkipState(seq=prompt[0, :1], row=b) for b, prompt in enumerate(prompts)]

    def compile_with(self, compile: bool | str) -> None:
        self._compiled = bool(compile)

    def before_draft(self, cache: Any, lengths: list[int], pads: list[int]) -> None:
        self._step = (cache, lengths, pads)

    def propose_rows(self, states: list[LayerSkipState], roots: list[Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        step, self._step = self._step, None
        if step is None or self.entry_model is None or self._compiled:
            return super().propose_rows(states, roots, sampling, max_depths)
        return self._shared_drafts(*step, states, roots, sampling, max_depths)

    @torch.inference_mode()
    def _shared_drafts(self, cache: Any, lengths: list[int], pads: list[int], states: list[LayerSkipState],
                       roots: list[Tensor], sampling: Sampling, max_depths: list[int]) -> list[Draft]:
        """Every row's chain through the first k layers over the target's ``cache`` (one forward per
        level for all of its rows; rows not drafting feed a dummy token at their own next slot, which
        their verify overwrites), each node's KV written where the verify puts it."""
        device = roots[0].device
        levels = max(0, min(self.option.length, max(max_depths)))
        start = torch.tensor(lengths, device=device)  # (B,) each row's root slot
        pad = torch.tensor(pads, device=device)
        index = torch.tensor([s.row for s in states], device=device)
        tokens = torch.zeros(len(lengths), dtype=torch.long, device=device)
        tokens[index] = torch.stack(roots)
        width = max(lengths) + levels + 1
        cache.grow(width)
        cache.window = width
        col = torch.arange(width, device=device)[None]  # (1, W)
        dtype = self._lm_head.weight.dtype
        entries, drafted, laws = [], [], []
        for level in range(levels + 1):  # the root and every draft, the last one too (its KV)
            slot = (start + level)[:, None]  # (B, 1)
            mask = additive_mask(((col >= pad[:, None]) & (col <= slot))[:, None, :], dtype)[0, 0][:, None]
            masks = attention_masks(self._config, mask, slot - pad[:, None], col - pad[:, None])
            cache.slots = slot
            hidden = self._shallow(input_ids=tokens[:, None], attention_mask=masks, position_ids=slot - pad[:, None],
                                   use_cache=True, **cache_kwargs(self._shallow, cache)).last_hidden_state[:, 0]  # (B, H)
            entries.append(hidden)
            if level == levels:
                break
            logits = self._lm_head(self._norm(hidden)).float()  # (B, V)
            if sampling.greedy:
                tokens = logits.argmax(dim=-1)
            else:
                q = sampling.probs(logits)
                tokens = torch.multinomial(q, 1)[:, 0]
                laws.append(q)
            drafted.append(tokens)
        entry = torch.stack(entries, dim=1)[index]  # (R, levels + 1, H)
        chain = torch.stack([root.reshape(1) for root in roots] if not drafted else
                            [torch.cat([r.reshape(1), c]) for r, c in zip(roots, torch.stack(drafted, dim=1)[index])])
        law = torch.stack(laws, dim=1)[index] if laws else None
        drafts = []
        for i, depth in enumerate(max_depths):
            n = max(0, min(levels, depth))
            drafts.append(Draft(chain[i, : n + 1], chain_buffers(n, device), None if law is None else law[i, :n],
                                entry=entry[i, : n + 1]))
        return drafts
