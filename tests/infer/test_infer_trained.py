"""Briefly trained heads: real drafting with long accepted runs stays token-identical to HF greedy.

The target is a tiny Llama whose greedy continuation is partly learnable (its lm_head favours a
fixed successor of the current token, its layers add a small context-dependent part), so a head
trained for a few hundred steps on the target's own greedy outputs reaches tau > 1.5 and
exercises multi-token observation, deep trees and compaction with a real head.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.targets import make_successor_target

from draftsmith.heads import build_head
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.infer.drafters import default_branching_tree
from draftsmith.target.model import target_forward

VOCAB = 96


@pytest.fixture(scope="module")
def target_and_data():
    model = make_successor_target(VOCAB)
    with torch.no_grad():
        torch.manual_seed(0)
        prompts = torch.randint(3, VOCAB, (256, 4))
        seqs = model.generate(prompts, do_sample=False, max_new_tokens=40, pad_token_id=0,
                              attention_mask=torch.ones_like(prompts))
        out = target_forward(model, seqs, aux_layer_ids=(2, 3, 3))
    return model, seqs, out.final_hidden, out.aux_hidden


def train_head(kind: str, model, seqs, final, aux, steps: int = 200):
    """Teacher-forced next-next-token CE (+ feature regression for EAGLE-1); step 0 only."""
    torch.manual_seed(0)
    head = build_head(kind, model)
    opt = torch.optim.AdamW(head.parameters(), lr=5e-3)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    length = seqs.shape[1]
    pos = torch.arange(length - 1)[None].expand(32, -1)
    for _ in range(steps):
        idx = torch.randint(0, seqs.shape[0], (32,))
        tokens = seqs[idx]
        with torch.no_grad():
            emb = embed(tokens[:, 1:])
        if kind == "medusa":
            logits = head(final[idx])  # (K, B, T, V); head k at t predicts t + k + 2
            loss = sum(F.cross_entropy(logits[k, :, : length - k - 2].reshape(-1, VOCAB), tokens[:, k + 2 :].reshape(-1))
                       for k in range(logits.shape[0]))
        else:
            hidden = final[idx, :-1] if kind == "eagle" else head.project(aux[idx, :-1])
            out = head(hidden_states=hidden, inputs_embeds=emb, position_ids=pos).hidden_states
            logits = lm_head(out) if kind == "eagle" else head.compute_logits(out)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 2:].reshape(-1))
            if kind == "eagle":
                loss = loss + F.smooth_l1_loss(out, final[idx, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def trained(target_and_data):
    """One trained head per kind for the module (the eager and the traced decode read the same head)."""
    heads = {}

    def head(kind: str):
        if kind not in heads:
            heads[kind] = train_head(kind, *target_and_data)
        return heads[kind]
    return head


@pytest.fixture(scope="module")
def references(target_and_data):
    """The prompts, and HF's greedy continuations of them without and with an EOS inside what are now long accepted
    runs: every case decodes the same four prompts, so HF decodes them once for the module (was once a case)."""
    model = target_and_data[0]
    cases = []
    for i, ids in enumerate(torch.randint(3, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))):
        ids, max_new = ids[None], 25 + 7 * i
        ref = model.generate(ids, do_sample=False, max_new_tokens=max_new, pad_token_id=0)
        eos = int(ref[0, 5 + max_new // 2])
        expected = model.generate(ids, do_sample=False, max_new_tokens=max_new, pad_token_id=0, eos_token_id=eos)
        cases.append((ids, max_new, ref, eos, expected))
    return cases


@pytest.mark.parametrize("compile", [False, "eager"])  # eager: drafts at their own size; traced: padded to the budget
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_trained_head_is_lossless_with_long_runs(target_and_data, trained, references, kind, compile):
    model = target_and_data[0]
    head = trained(kind)
    # a real tree, and a chain (eager only: traced, each generator's shapes are traced anew, and the traced
    # chains' identity is test_infer_compiled_draft.py's)
    gen = SpeculativeGenerator(model, head, tree=default_branching_tree(kind, "cpu"), compile=compile)
    chain = None if compile else SpeculativeGenerator(model, head, tree=Chain(4))
    taus = []
    for ids, max_new, ref, eos, expected in references:
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new), ref)
        taus.append(gen.last_stats.tau)
        assert chain is None or torch.equal(chain.generate(ids, max_new_tokens=max_new), ref)
        assert torch.equal(gen.generate(ids, max_new_tokens=max_new, eos_token_id=eos), expected)
    assert sum(taus) / len(taus) > 1.5, taus
