"""train.mtp_unroll on a block of two MTP layers: teacher-forced on the drafts of the independent reference
(tests/support/mtp_layers.py), step k at the prompt's last position gives level k's reference logits, so the
head trains each layer on what it drafts (layer k mod 2 over the context and its own steps)."""
from __future__ import annotations

import pytest
import torch
from support.mtp_layers import make_layers_target, reference_layers_chain

from draftsmith.heads import build_head
from draftsmith.train.mtp_unroll import mtp_unroll

PROMPT = torch.tensor([[1, 5, 3, 6, 7, 4, 7]])


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return make_layers_target(tmp_path_factory.mktemp("mtp2") / "target")


@torch.no_grad()
def test_training_unrolls_the_layers_as_drafting_does(two):
    """train.mtp_unroll teacher-forced on the reference's own drafts: step k at the prompt's last position gives
    level k's reference logits (step k runs layer k mod 2 over the context and its own steps)."""
    head, k = build_head("mtp", two.model), 5
    want = reference_layers_chain(two, PROMPT, k)
    root = two.model(PROMPT).logits[0, -1].argmax()
    seq = torch.cat([PROMPT[0], root[None], torch.stack([w.argmax() for w in want])])[None]
    hidden = two.model(seq, output_hidden_states=True).hidden_states[-1]
    outs = list(mtp_unroll(head, hidden, two.model.get_input_embeddings()(seq), k))
    last = PROMPT.shape[1] - 1
    for level, (out, w) in enumerate(zip(outs, want)):
        torch.testing.assert_close(two.model.get_output_embeddings()(out[0, last]), w, rtol=1e-5, atol=1e-5,
                                   msg=f"step {level}")
