"""Whether a target's speculative verify computes what its own decode computes (``draftsmith check-target``).

Greedy speculative decoding is lossless only if a verify over N tokens, which runs the target once over
them with its cache, gives the logits the target's own ``generate`` gives running them one at a time. For
an attention model the two differ by fp32 rounding; a recurrent layer may run another function over
several tokens than over one (docs/hybrid.md: Jamba's Mamba-1 ignores its state, Nemotron-H's Mamba-2 clamps
dt in its chunked scan only). ``trajectory_gap`` (what ``can_be_exact`` and ``draftsmith check-target`` run)
takes short greedy runs of the target's own ``generate`` and verifies the same tokens ``steps`` at a time
through transformers' cache (``DynamicCache``), as a speculative decode whose drafts are all accepted runs
them (inside the routes the generator enters: ``target.delta_rule.per_token_rule``): a difference that shows
only where some state reaches a rare value (a clamp) needs many positions, not one verify. ``decode_gap`` is
one such verify of the last ``steps`` tokens of a short input against ``steps`` one-token forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from draftsmith.target.delta_rule import per_token_modules, per_token_rule
from draftsmith.target.recurrent import LAYER_KINDS, REFUSED_KINDS, check_supported, is_hybrid, model_type, unsupported

# The largest logit difference read as rounding: relative to the largest logit (fp32; measured in
# docs/hybrid.md: up to 8e-6 of it for fp32 rounding on tests/support/hybrids.py, 9e-5..2 where the function differs).
RELATIVE_TOLERANCE = 2e-5


@dataclass
class DecodeGap:
    max_diff: float  # max |logit difference| over the compared positions
    scale: float  # max |logit| there
    argmax_agree: int  # positions whose greedy token agrees
    positions: int

    @property
    def exact(self) -> bool:
        return self.max_diff <= RELATIVE_TOLERANCE * max(1.0, self.scale) and self.argmax_agree == self.positions


def _logits(model: nn.Module, ids: Tensor, cache, start: int) -> Tensor:
    """``ids`` (1, n) at positions start.. (given, as ``generate`` gives them: some models derive them from a
    cache length their recurrent layers do not count)."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits[0].float()


@torch.inference_mode()
def decode_gap(model: nn.Module, ids: Tensor, steps: int = 8, routes: tuple | None = None) -> DecodeGap:
    """The verify of ``ids``' (1, L) last ``steps`` tokens after its prefix against the same tokens one at a
    time, both from transformers' cache after the prefix. ``routes``: what the verify routes (None: what the
    generator would, ``per_token_modules(model)``; ``()``: transformers' code alone)."""
    routes = per_token_modules(model) if routes is None else routes
    prefix, tail, start = ids[:, :-steps], ids[:, -steps:], ids.shape[1] - steps
    cache = DynamicCache(config=model.config)
    _logits(model, prefix, cache, 0)
    with per_token_rule(routes):
        verify = _logits(model, tail, cache, start)
    cache = DynamicCache(config=model.config)
    _logits(model, prefix, cache, 0)
    steps_out = torch.cat([_logits(model, tail[:, t: t + 1], cache, start + t) for t in range(steps)])
    return DecodeGap(float((verify - steps_out).abs().max()), float(steps_out.abs().max()),
                     int((verify.argmax(-1) == steps_out.argmax(-1)).sum()), steps)


def probe_ids(model: nn.Module, length: int = 20, seed: int = 0) -> Tensor:
    """A short input (1, ``length``): BOS-free random ids of the model's vocabulary, on its device."""
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    return torch.randint(min(3, vocab - 1), vocab, (1, length), generator=gen).to(device)


def gap_line(gap: DecodeGap) -> str:
    """The comparison in words."""
    return (f"max |logit difference| {gap.max_diff:.2g} (largest logit {gap.scale:.3g}), the same greedy token at "
            f"{gap.argmax_agree} of {gap.positions} positions")


@torch.inference_mode()
def trajectory_gap(model: nn.Module, prompts: list[Tensor], new_tokens: int = 32, steps: int = 8,
                   routes: tuple | None = None) -> DecodeGap:
    """Each prompt's (1, L) greedy run of ``new_tokens`` by ``model.generate`` (its own decode) against the same
    tokens verified ``steps`` at a time after the prompt's prefill, both from transformers' cache: the logits
    that chose each generated token. A position agrees when the verify's greedy token is ``generate``'s, or
    ties with it within ``RELATIVE_TOLERANCE`` under ``generate``'s logits (rounding may settle a tie either
    way). ``routes``: as for ``decode_gap``."""
    routes = per_token_modules(model) if routes is None else routes
    config = getattr(model, "generation_config", None)
    pad = next((t for t in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None), 0)
                if t is not None), 0)
    diff = scale = 0.0
    agree = positions = 0
    for ids in prompts:
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens,  # past EOS: the logits compared are the raw ones
                             pad_token_id=pad[0] if isinstance(pad, list) else pad, output_logits=True,
                             return_dict_in_generate=True)
        tokens, want = ref.sequences[:, ids.shape[1]:], torch.stack(ref.logits, 1)[0].float()  # want[i] chose tokens[i]
        cache = DynamicCache(config=model.config)
        got = [_logits(model, ids, cache, 0)[-1:]]
        for start in range(0, tokens.shape[1] - 1, steps):
            with per_token_rule(routes):
                got.append(_logits(model, tokens[:, start: min(start + steps, tokens.shape[1] - 1)], cache,
                                   ids.shape[1] + start))
        got = torch.cat(got)
        diff, scale = max(diff, float((got - want).abs().max())), max(scale, float(want.abs().max()))
        chosen = want.gather(-1, got.argmax(-1, keepdim=True))[:, 0]
        agree += int((want.amax(-1) - chosen <= RELATIVE_TOLERANCE * max(1.0, scale)).sum())
        positions += want.shape[0]
    return DecodeGap(diff, scale, agree, positions)


def can_be_exact(model: nn.Module, steps: int = 8, prompts: int = 2, new_tokens: int = 32) -> tuple[bool, str]:
    """Whether greedy speculative decoding on ``model`` can be exact, and one line saying why (or why not):
    a refused or untested stateful family, or verifies that compute something else than ``generate``'s
    one-token steps along ``prompts`` greedy runs of ``new_tokens`` (``trajectory_gap``)."""
    name = f"{type(model).__name__} ({model_type(model)})"
    if model_type(model) in REFUSED_KINDS:
        return False, unsupported(model)
    gap = trajectory_gap(model, [probe_ids(model, 12, seed) for seed in range(prompts)], new_tokens, steps)
    compared = (f"{prompts} greedy runs of {new_tokens} tokens by its own generate against the same tokens verified "
                f"{steps} at a time through the cache: {gap_line(gap)}")
    if not gap.exact:
        return False, (f"{name}: speculative decoding cannot be exact: {compared} (more than fp32 rounding, "
                       f"{RELATIVE_TOLERANCE:g} of the largest logit: its layers compute something else over several "
                       "tokens than over one)")
    if is_hybrid(model) and model_type(model) not in LAYER_KINDS:
        return False, f"{unsupported(model)}; {compared}"
    return True, f"{name}: speculative decoding can be exact: {compared} (fp32 rounding)"


_UNTESTED: dict[str, str] = {}  # model_type -> the refusal of an untested stateful family, with its check


def check_family(model: nn.Module) -> None:
    """``target.recurrent.check_supported`` for a target the generator meets: a stateful family outside
    ``LAYER_KINDS`` is refused with what ``draftsmith check-target`` says of it (its verify against one-token
    steps), checked the first time a process meets the family."""
    try:
        check_supported(model)
    except ValueError:
        mtype = model_type(model)
        if mtype in REFUSED_KINDS or mtype in LAYER_KINDS:  # refused by kind, or an old transformers
            raise
        if mtype not in _UNTESTED:
            try:
                _UNTESTED[mtype] = can_be_exact(model)[1]
            except Exception as err:  # noqa: BLE001 - a family whose forward cannot run the check: say so
                _UNTESTED[mtype] = f"{unsupported(model)}; its consistency check could not run ({type(err).__name__})"
        raise ValueError(_UNTESTED[mtype]) from None


__all__ = ["DecodeGap", "RELATIVE_TOLERANCE", "can_be_exact", "check_family", "decode_gap", "gap_line", "probe_ids",
           "trajectory_gap"]
