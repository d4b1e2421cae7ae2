"""train.loss=dpace on both kinds that take it, against the weights written out with loops: a DFlash block's
positions and an EAGLE-3 position's TTT steps are each one chain."""
from __future__ import annotations

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.train.config import load_config
from draftsmith.train.objectives import objective_class
from draftsmith.train.losses import soft_ce
from draftsmith.train.objectives.dflash import block_labels


def _dpace_by_hand(elements: list[list[float]], confidence: list[list[float]], valid: list[list[bool]],
                   alpha: float) -> float:
    """sum(w * l) / sum(w) over chains, w_j = sum_{m >= j} prod_{i <= m} q~_i, written out with loops."""
    num = den = 0.0
    for chain_l, chain_q, chain_v in zip(elements, confidence, valid):
        survive, prod = [], 1.0
        for q, v in zip(chain_q, chain_v):
            prod *= alpha + (1 - alpha) * q if v else 1.0
            survive.append(prod if v else 0.0)
        for j, (loss, v) in enumerate(zip(chain_l, chain_v)):
            w = sum(survive[j:]) if v else 0.0
            num, den = num + w * loss, den + w
    return num / den


def test_dflash_dpace_loss_by_hand():
    from draftsmith.train.objectives.dflash import block_outputs, sequence_context

    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=4, num_layers=1)
    objective = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash", "train.loss=dpace",
                                                                    "train.dpace_alpha=0.3"]))
    ids = torch.randint(3, 96, (2, 14))
    loss_mask = torch.ones_like(ids)
    loss_mask[0, 9] = 0  # a gap: blocks before it stop there
    features = objective.features(target, {"input_ids": ids, "loss_mask": loss_mask}, head)
    objective.perturb(features, None, seed=3)
    lm_head = target.get_output_embeddings()
    out = objective(features, lm_head)
    with torch.no_grad():
        blocks = block_outputs(head, features, features.anchors, sequence_context(head, features))
        elements, confidence, valid = [], [], []
        trained = block_labels(loss_mask, features.anchors, features.anchor_keep, 4)
        for b in range(2):
            for n in range(features.anchors.shape[1]):
                a = int(features.anchors[b, n])
                chain = [(k, min(a + k, 13)) for k in range(1, 4)]
                logits = [lm_head(blocks[b, n, k]) for k, _ in chain]
                elements.append([float(soft_ce(lg, features.targets.probs[b, t - 1]))
                                 for lg, (_, t) in zip(logits, chain)])
                confidence.append([float(lg.softmax(-1)[features.top1[b, t - 1]]) for lg, (_, t) in zip(logits, chain)])
                valid.append([bool(trained[b, n, k]) for k, _ in chain])
    assert sum(map(sum, valid)) > 0 and not all(map(all, valid))
    assert float(out.loss) == pytest.approx(_dpace_by_hand(elements, confidence, valid, 0.3), rel=1e-5)


def test_eagle3_dpace_loss_by_hand():
    from draftsmith.train.unroll import unroll

    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = build_head("eagle3", target)
    cfg = load_config(None, ["head.kind=eagle3", "head.ttt_steps=3", "train.loss=dpace"])
    objective = objective_class("eagle3", head.config.variant)(head, cfg)
    ids = torch.randint(3, 96, (2, 10))
    loss_mask = torch.ones_like(ids)
    loss_mask[1, 6] = 0
    features = objective.features(target, {"input_ids": ids, "loss_mask": loss_mask}, head)
    out = objective(features)
    with torch.no_grad():
        steps = [head.compute_logits(o) for o in unroll(head, head.project(features.hidden), features.embeds, 3)]
        elements, confidence, valid = [], [], []
        for b in range(2):
            for i in range(8):  # positions with a drafted token i + 2
                chain_l, chain_q, chain_v = [], [], []
                for k in range(3):
                    j = i + 1 + k  # the target's law that step k at i imitates
                    v = j + 1 < 10 and bool(loss_mask[b, j + 1])
                    probs = features.targets.probs[b, min(j, 9)]
                    logits = steps[k][b, i]
                    chain_l.append(float(soft_ce(logits, probs)) if v else 0.0)
                    chain_q.append(float(logits.softmax(-1)[probs.argmax()]) if v else 0.0)
                    chain_v.append(v)
                elements.append(chain_l)
                confidence.append(chain_q)
                valid.append(chain_v)
    assert float(out.loss) == pytest.approx(_dpace_by_hand(elements, confidence, valid, 0.5), rel=1e-5)
