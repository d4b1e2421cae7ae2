"""An EAGLE-3 head's draft step run by infer.drafters.shared.lean_eagle3 gives what the head's forward gives, bit for
bit, over several cached steps (with and without EAGLE-3.1's output norm, biases, a reduced vocabulary, one row and a
left-padded pair of rows); the drafter runs it on an eager decode and drafts as the modules do; what it cannot
reproduce (a hook, a LoRA or other linear, training mode, a P-EAGLE head, a disagreeing self-check) runs the modules.
A chain step of one entry per row at one length runs without a mask (``EagleDrafter._batched_step``), as the
masked step does.

Plants (each made once, each failed the test named): the output norm skipped (test_lean_equals_the_forward[norm]);
the hidden and embedding norms swapped (test_lean_equals_the_forward[norm]); the self-check always agreeing
(test_what_it_cannot_reproduce_runs_the_modules); the lean step never built by the drafter
(test_the_drafter_drafts_on_it_and_alike); the mask dropped whenever T = 1, rows at different lengths included
(test_a_step_without_its_mask_is_the_masked_step)."""
from __future__ import annotations

import pytest
import torch
from support.reference import hf_greedy
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.cache import StaticHeadCache
from draftsmith.infer.drafters import eagle3
from draftsmith.infer.drafters.eagle3 import Eagle3Drafter
from draftsmith.infer.drafters.shared import lean_eagle3
from draftsmith.infer.drafters.shared.lean_eagle3 import LeanEagle3
from draftsmith.heads.layers import HeadCache


def _head(norm_output: bool = True, bias: bool = False, draft_vocab_size: int | None = None, seed: int = 0):
    """(a tiny Llama target without EOS, an EAGLE-3 head of it in eval mode with every weight random and sharp)."""
    target = make_tiny_target("llama", dtype=torch.float32)
    target.generation_config.eos_token_id = None
    torch.manual_seed(seed)
    head = build_head("eagle3", target, norm_output=norm_output, attention_bias=bias, mlp_bias=bias,
                      **({"draft_vocab_size": draft_vocab_size} if draft_vocab_size else {}))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return target, head.eval()


@pytest.mark.parametrize("norm_output,bias", [(True, False), (False, True)], ids=["norm", "plain-bias"])
def test_lean_equals_the_forward(norm_output, bias):
    _, head = _head(norm_output, bias)
    lean = LeanEagle3(head)
    width = head.config.hidden_size
    caches = HeadCache(), HeadCache()
    gen = torch.Generator().manual_seed(1)
    start = 0
    for t in (5, 1, 1, 3):  # observed tokens, two draft levels, a verify's accepted tokens
        hidden, embeds = torch.randn(2, t, width, generator=gen), torch.randn(2, t, width, generator=gen)
        positions = torch.arange(start, start + t)[None].expand(2, -1)
        mask = None
        if t > 1 and start:  # row 1 left-padded: its first cached slot hidden
            allowed = torch.ones(2, t, start + t, dtype=torch.bool).tril_(start)
            allowed[1, :, 0] = False
            mask = torch.zeros(2, 1, t, start + t).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
        with torch.inference_mode():
            ours = lean(hidden, embeds, positions, mask, caches[0])
            theirs = head(hidden_states=hidden, inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                          past_key_values=caches[1]).hidden_states
        assert torch.equal(ours, theirs), (norm_output, t, (ours - theirs).abs().max().item())
        start += t
    assert lean_eagle3.lean_eagle3(head) is not None


def test_what_it_cannot_reproduce_runs_the_modules(monkeypatch):
    from peft import LoraConfig, get_peft_model

    _, head = _head()
    handle = head.midlayer.mlp.register_forward_hook(lambda *a: None)
    assert lean_eagle3.lean_eagle3(head) is None
    handle.remove()
    assert lean_eagle3.lean_eagle3(head) is not None
    assert lean_eagle3.lean_eagle3(_head()[1].train()) is None
    lora = get_peft_model(_head()[1], LoraConfig(r=2, target_modules=["q_proj"]))
    assert lean_eagle3.lean_eagle3(lora.get_base_model()) is None  # LoRA layers injected in place
    peagle = build_head("eagle3", make_tiny_target("llama"), variant="peagle").eval()
    assert lean_eagle3.lean_eagle3(peagle) is None
    _, fresh = _head(seed=1)
    monkeypatch.setattr(lean_eagle3, "rotate_half", lambda x: torch.cat((x[..., 1:], x[..., :1]), dim=-1))  # differs
    assert lean_eagle3.LeanEagle3(fresh) is not None and lean_eagle3.lean_eagle3(fresh) is None


@pytest.mark.parametrize("draft_vocab_size", [None, 48], ids=["full-vocab", "reduced-vocab"])
def test_the_drafter_drafts_on_it_and_alike(monkeypatch, draft_vocab_size):
    target, head = _head(draft_vocab_size=draft_vocab_size)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9, 11]])
    runs = []
    for lean in (True, False):
        if not lean:  # the modules' run
            monkeypatch.setattr(eagle3, "lean_eagle3", lambda head: None)
        drafter = Eagle3Drafter(head, target, Chain(4))
        gen = SpeculativeGenerator(target, drafter)
        out = gen.generate(ids, max_new_tokens=24)
        runs.append((out, gen.last_stats.tau, drafter._lean))
    (lean_out, lean_tau, lean_step), (module_out, module_tau, module_step) = runs
    assert lean_step is not None and module_step is None  # the eager decode ran the lean step; the other the modules
    assert torch.equal(lean_out, hf_greedy(target, ids, 24)) and torch.equal(lean_out, module_out)
    assert lean_tau == module_tau  # the same drafts, step for step


def test_a_step_without_its_mask_is_the_masked_step():
    target, head = _head()
    drafter = Eagle3Drafter(head, target, Chain(4))
    width = head.config.hidden_size
    gen = torch.Generator().manual_seed(2)
    for lengths in ([6, 6], [6, 4]):  # one length (no mask) and two (the causal mask hides row 1's stale slots)
        cache = StaticHeadCache(32, rows=2)
        with torch.inference_mode():
            drafter._batched_step(cache, torch.randn(2, 6, width, generator=gen), torch.randint(0, 64, (2, 6)),
                                  counts=lengths)
            hidden, tokens = torch.randn(2, 1, width, generator=gen), torch.randint(0, 64, (2, 1))
            masked = head(hidden_states=hidden, inputs_embeds=drafter.embed(tokens),
                          position_ids=torch.tensor(lengths)[:, None],
                          attention_mask=cache.causal_mask(1, hidden.dtype, hidden.device),
                          past_key_values=cache).hidden_states
            cache.crop_rows(lengths)
            stepped = drafter._batched_step(cache, hidden, tokens)
        assert torch.equal(stepped, masked), lengths
