"""Losses on hand-made tensors: values computed by hand and the label alignment of every step."""
from __future__ import annotations

import math

import pytest
import torch

from draftsmith.train.losses import (
    decayed_sum,
    eagle_loss,
    medusa_loss,
    restrict_to_draft_vocab,
    step_slices,
    ttt_step_loss,
)


def test_step_slices_align_draft_target_and_label():
    pos, tgt, label = step_slices(seq_len=6, step=1)
    idx = torch.arange(6)
    # draft position i, target position i+2 (= i+1+k), drafted token i+3 (= i+2+k)
    assert idx[pos].tolist() == [0, 1, 2]
    assert idx[tgt].tolist() == [2, 3, 4]
    assert idx[label].tolist() == [3, 4, 5]
    assert step_slices(3, 5)[0] == slice(0, 0)  # too short: nothing to train


def test_decayed_sum():
    total = decayed_sum([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], 0.8)
    assert total.item() == pytest.approx(1 + 0.8 * 2 + 0.64 * 3)


def test_medusa_loss_value_by_hand():
    # K=2, B=1, T=5, V=4; only token 2 is a training target.
    input_ids = torch.tensor([[0, 1, 2, 3, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 0, 0]])
    logits = torch.zeros(2, 1, 5, 4)
    logits[0, 0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0]).log()  # head 0 at t=0 predicts token 2
    out = medusa_loss(logits, input_ids, loss_mask, decay=0.8)
    # head 0: one position, p(label=2) = 3/10; head 1 (tokens 3..4) has no trained position.
    assert out.loss.item() == pytest.approx(-math.log(0.3), rel=1e-6)
    assert out.count.tolist() == [1.0, 0.0]
    assert out.correct.tolist() == [0.0, 0.0]  # argmax is 3, the label 2


def test_medusa_loss_uniform_and_alignment():
    input_ids = torch.tensor([[5, 1, 2, 3, 4, 0, 6]])
    loss_mask = torch.ones_like(input_ids)
    k_heads, seq_len, vocab = 3, 7, 8
    uniform = medusa_loss(torch.zeros(k_heads, 1, seq_len, vocab), input_ids, loss_mask, decay=0.8)
    assert uniform.loss.item() == pytest.approx((1 + 0.8 + 0.64) * math.log(vocab), rel=1e-6)
    assert uniform.count.tolist() == [5.0, 4.0, 3.0]  # T - 2 - k positions per head

    right = torch.zeros(k_heads, 1, seq_len, vocab)
    wrong = torch.zeros(k_heads, 1, seq_len, vocab)
    for k in range(k_heads):
        for t in range(seq_len - 2 - k):
            right[k, 0, t, input_ids[0, t + k + 2]] = 30.0  # head k at t predicts token t+k+2
            wrong[k, 0, t, input_ids[0, t + k + 1]] = 30.0  # off by one
    good = medusa_loss(right, input_ids, loss_mask, decay=0.8)
    bad = medusa_loss(wrong, input_ids, loss_mask, decay=0.8)
    assert good.loss.item() < 1e-6
    assert torch.equal(good.correct, good.count)
    assert bad.loss.item() > 10


def test_eagle_loss_value_by_hand():
    torch.manual_seed(0)
    feats = torch.randn(1, 4, 2)  # f at positions 0..3
    pred = torch.zeros(1, 4, 2)
    pred[:, :3] = feats[:, 1:] + 0.5  # f̂ at i predicts f_{i+1}; every element off by 0.5
    target_logits = torch.tensor([0.0, math.log(3.0)]).expand(1, 4, 2)  # p = [1/4, 3/4]
    pred_logits = torch.zeros(1, 4, 2)  # q = [1/2, 1/2]
    loss_mask = torch.tensor([[0, 0, 1, 1]])  # positions i = 0, 1 draft tokens 2, 3
    out = eagle_loss(pred, pred_logits, feats, target_logits, loss_mask, ce_weight=0.1)
    smooth_l1 = 0.5 * 0.5**2  # |d| < 1: 0.5 d^2, averaged over H
    soft_ce = math.log(2.0)
    assert out.loss.item() == pytest.approx(smooth_l1 + 0.1 * soft_ce, rel=1e-6)
    assert out.count.tolist() == [2.0]


def test_eagle_loss_ignores_masked_positions():
    feats = torch.randn(1, 5, 3)
    pred = torch.zeros(1, 5, 3)
    pred[:, :4] = feats[:, 1:]
    logits = torch.randn(1, 5, 6)
    pred_logits = torch.zeros(1, 5, 6)
    pred_logits[:, :4] = logits[:, 1:]
    mask = torch.tensor([[0, 0, 1, 1, 0]])
    exact = eagle_loss(pred, pred_logits, feats, logits, mask)
    entropy = -(logits[:, 1:3].softmax(-1) * logits[:, 1:3].log_softmax(-1)).sum(-1).mean()
    assert exact.loss.item() == pytest.approx(0.1 * entropy.item(), rel=1e-5)  # no regression error
    pred[:, 3] += 100.0  # position 3 drafts token 5, which does not exist: must not count
    assert eagle_loss(pred, pred_logits, feats, logits, mask).loss.item() == pytest.approx(exact.loss.item())


def test_restrict_to_draft_vocab():
    t2d = torch.tensor([True, False, True, True, False])
    logits = torch.tensor([[[1.0, 5.0, 2.0, 0.0, 0.0],  # top-1 = 1, outside the draft vocab
                            [0.0, 0.0, 3.0, 1.0, 0.0]]])
    targets = restrict_to_draft_vocab(logits, t2d)
    assert targets.probs.shape == (1, 2, 3)
    torch.testing.assert_close(targets.probs[0, 0], torch.tensor([1.0, 2.0, 0.0]).softmax(-1))
    assert targets.top1.tolist() == [[1, 2]]
    assert targets.in_vocab.tolist() == [[False, True]]
    full = restrict_to_draft_vocab(logits, None)
    assert full.probs.shape == (1, 2, 5) and full.in_vocab.all()


def test_ttt_step_loss_value_and_masks():
    # T=4, Vd=3: step 0 draft position i imitates target position i+1 and drafts token i+2.
    probs = torch.tensor([[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    targets = restrict_to_draft_vocab(probs.log().clamp(min=-1e4), None)
    draft = torch.zeros(1, 4, 3)
    draft[0, 0] = torch.tensor([0.25, 0.25, 0.5]).log()  # vs [0.5, 0.5, 0]: CE = log 4
    draft[0, 1] = torch.tensor([0.1, 0.1, 0.8]).log()  # vs [0, 0, 1]: CE = -log 0.8
    out = ttt_step_loss(draft, targets, torch.ones(1, 4, dtype=torch.long), step=0)
    assert out.loss.item() == pytest.approx((math.log(4) - math.log(0.8)) / 2, rel=1e-5)
    assert out.count.item() == 2 and out.correct.item() == 1  # position 0: argmax 2 vs 0 (or 1)

    # target top-1 outside the draft vocab -> that position is not trained
    masked = targets._replace(in_vocab=torch.tensor([[True, False, True, True]]))
    out = ttt_step_loss(draft, masked, torch.ones(1, 4, dtype=torch.long), step=0)
    assert out.count.item() == 1
    assert out.loss.item() == pytest.approx(-math.log(0.8), rel=1e-5)


@pytest.mark.parametrize("step", [0, 1, 2])
def test_ttt_step_alignment(step):
    torch.manual_seed(step)
    seq_len, vocab = 8, 5
    target_logits = 30 * torch.nn.functional.one_hot(torch.randint(0, vocab, (1, seq_len)), vocab).float()
    targets = restrict_to_draft_vocab(target_logits, None)
    right = torch.zeros(1, seq_len, vocab)
    right[:, : seq_len - 1 - step] = target_logits[:, 1 + step:]  # draft at i imitates target at i+1+k
    mask = torch.ones(1, seq_len, dtype=torch.long)
    good = ttt_step_loss(right, targets, mask, step)
    assert good.loss.item() < 1e-6 and good.correct.item() == good.count.item() == seq_len - 2 - step
    shifted = ttt_step_loss(torch.roll(right, 1, dims=1), targets, mask, step)
    assert shifted.loss.item() > 1.0


def test_dpace_weights_by_hand():
    from draftsmith.train.losses import dpace_weights

    # q = [0.8, 0.5], alpha 0.5: q~ = [0.9, 0.75], survival C = [0.9, 0.675], w_j = sum_{m>=j} C_m
    w = dpace_weights(torch.tensor([[0.8, 0.5]]), torch.ones(1, 2, dtype=torch.bool), 0.5)
    torch.testing.assert_close(w, torch.tensor([[1.575, 0.675]]))
    # an invalid middle position: a no-op in the product, no weight of its own
    w = dpace_weights(torch.tensor([[0.8, 0.1, 0.5]]), torch.tensor([[True, False, True]]), 0.5)
    torch.testing.assert_close(w, torch.tensor([[1.575, 0.0, 0.675]]))
    # alpha = 1: every q~ is 1, w_j = the number of valid positions from j on
    w = dpace_weights(torch.tensor([[0.3, 0.2, 0.9]]), torch.ones(1, 3, dtype=torch.bool), 1.0)
    torch.testing.assert_close(w, torch.tensor([[3.0, 2.0, 1.0]]))
    with pytest.raises(ValueError, match="alpha must lie in"):
        dpace_weights(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.0)


def test_acceptance_rate_is_the_overlap_of_the_two_laws():
    from draftsmith.train.metrics import acceptance_rate

    p = torch.tensor([0.5, 0.5, 0.0])
    q_logits = torch.tensor([1.0, 1.0, 2.0]).log()  # q = [0.25, 0.25, 0.5]
    assert acceptance_rate(q_logits, p).item() == pytest.approx(0.5)
    assert acceptance_rate(p.clamp(min=1e-12).log(), p).item() == pytest.approx(1.0)


def test_on_policy_loss_by_hand():
    from draftsmith.train.losses import on_policy_loss

    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.25, 0.25], [0.6, 0.2, 0.2], [0.2, 0.2, 0.6]])
    since = torch.tensor([-1, 0, 1])  # accepted, the first rejection, one past it
    total, fkl, rkl = on_policy_loss(q.log(), p.log(), since, torch.ones(3, dtype=torch.bool), decay=0.5)
    f0 = -(p[0] * q[0].log()).sum()
    r1 = (q[1] * (q[1] / p[1]).log()).sum()
    r2 = (q[2] * (q[2] / p[2]).log()).sum()
    torch.testing.assert_close(total, f0 + r1 + 0.5 * r2)
    torch.testing.assert_close(fkl, torch.stack([f0, torch.tensor(0.0), torch.tensor(0.0)]))
    torch.testing.assert_close(rkl, torch.stack([torch.tensor(0.0), r1, r2]))
    masked, _, _ = on_policy_loss(q.log(), p.log(), since, torch.tensor([True, False, True]), decay=0.5)
    torch.testing.assert_close(masked, f0 + 0.5 * r2)
    s = torch.tensor([[0.2, 0.2, 0.6], [0.5, 0.4, 0.1], [0.1, 0.8, 0.1]])  # the law after the accepted prefix
    total, fkl, after = on_policy_loss(q.log(), p.log(), since, torch.ones(3, dtype=torch.bool), 0.5, s.log())
    c1, c2 = -(s[1] * q[1].log()).sum(), -(s[2] * q[2].log()).sum()  # soft CE there, p not read
    torch.testing.assert_close(total, f0 + c1 + 0.5 * c2)
    torch.testing.assert_close(after, torch.stack([torch.tensor(0.0), c1, c2]))
