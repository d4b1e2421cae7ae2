"""Acceptance metrics on hand-made correctness tables."""
from __future__ import annotations

import pytest
import torch

from draftsmith.train.metrics import AcceptanceMeter, format_acceptance, step_correctness


def test_step_correctness_alignment():
    # K=2 steps, T=5. Step k at position i drafts token i+2+k, compared with target top-1 at i+1+k.
    target_top1 = torch.tensor([[9, 10, 11, 12, 13]])
    draft = torch.tensor([[[10, 11, 0, 0, 0]],  # step 0: right at i=0, 1; wrong at i=2
                          [[11, 0, 0, 0, 0]]])  # step 1: right at i=0; wrong at i=1
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    correct, valid = step_correctness(draft, target_top1, mask)
    assert correct.tolist() == [[[True, True, False]], [[True, False, False]]]
    assert valid.tolist() == [[[True, True, True]], [[True, True, False]]]  # step 1, i=2 -> token 5


def test_meter_acc_conditional_and_tau_by_hand():
    # 4 positions, 3 steps; all valid. Leading correct runs: 3, 1, 0, 2 -> tau = 1 + 6/4.
    correct = torch.tensor([[1, 1, 0, 1],
                            [1, 0, 1, 1],
                            [1, 1, 1, 0]], dtype=torch.bool)
    meter = AcceptanceMeter(3)
    meter.update(correct, torch.ones_like(correct))
    m = meter.compute()
    assert m["acc"] == pytest.approx([0.75, 0.75, 0.75])
    assert m["cond_acc"] == pytest.approx([0.75, 2 / 3, 1 / 2])
    assert m["tau"] == pytest.approx(2.5)
    assert m["tau"] == pytest.approx(1 + 0.75 + 0.75 * 2 / 3 + 0.75 * 2 / 3 * 1 / 2)
    assert m["positions"] == 4
    assert "simulated tau 2.500" in format_acceptance(m)


def test_meter_excludes_invalid_positions_and_sums_updates():
    correct = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)  # position 1 has no step-1 token
    meter = AcceptanceMeter(2)
    meter.update(correct, valid)
    meter.update(correct, valid)
    m = meter.compute()
    assert m["acc"] == pytest.approx([0.5, 1.0])
    assert m["positions"] == 2  # only position 0 (twice) has all steps valid
    assert m["tau"] == pytest.approx(3.0)
