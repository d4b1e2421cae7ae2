"""DFlash as its authors train it, each piece against a hand computation: anchors drawn per document
inside runs of training targets, block labels that stop at a gap or a document's end, the block layout
(slot k drafts token a+k), the paper's decay exp(-(k-1)/gamma), and the mask token's check."""
from __future__ import annotations

import math

import pytest
import torch
from support.targets import make_tiny_target
from support.train_fixtures import tiny_files  # noqa: F401  (fixture)

from draftsmith.heads import build_head
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.losses import DraftTargets
from draftsmith.train.objectives import objective_class
from draftsmith.train.anchors import draw_anchors
from draftsmith.train.objectives.dflash import DFlashFeatures, block_labels, block_mask, check_mask_token, default_gamma


def test_anchors_start_where_the_anchor_and_its_first_label_are_training_targets():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 0]])
    anchors, keep = draw_anchors(loss_mask, 10, torch.Generator().manual_seed(0))
    # row 0: a in 1..6 with mask[a] = mask[a+1] = 1 -> 3, 4, 5 (6 is followed by a 0); row 1: none
    assert anchors[0][keep[0]].tolist() == [3, 4, 5]
    assert not keep[1].any()
    few, keep_few = draw_anchors(loss_mask, 2, torch.Generator().manual_seed(0))
    assert keep_few[0].sum() == 2 and set(few[0][keep_few[0]].tolist()) <= {3, 4, 5} and few[0, 0] < few[0, 1]


def test_anchors_are_counted_per_document_of_a_packed_row():
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    for seed in range(5):
        anchors, keep = draw_anchors(loss_mask, 2, torch.Generator().manual_seed(seed), document_ids=docs)
        drawn = anchors[keep].tolist()
        # document 0: a in 1..3 (a = 4's first label, 5, is in document 1); document 1: 5..8; two each
        assert len(drawn) == 4, drawn
        assert len([a for a in drawn if a in (1, 2, 3)]) == 2 and len([a for a in drawn if 5 <= a <= 8]) == 2, drawn
    single, keep = draw_anchors(loss_mask, 2, torch.Generator().manual_seed(0))
    assert keep.sum() == 2  # one document: two anchors in the row


def test_anchor_spacing_keeps_anchors_apart():
    loss_mask = torch.ones(3, 40, dtype=torch.long)
    anchors, keep = draw_anchors(loss_mask, 100, torch.Generator().manual_seed(0), spacing=4)
    for row, k in zip(anchors, keep):
        drawn = row[k].tolist()
        assert len(drawn) >= 38 // 7 and all(b - a >= 4 for a, b in zip(drawn, drawn[1:])), drawn


def test_block_labels_stop_at_a_gap_and_at_the_documents_end():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]])
    trained = block_labels(loss_mask, torch.tensor([[1, 5]]), torch.tensor([[True, True]]), 4)
    # anchor 1 drafts 2, 3, 4: 4 is a gap; anchor 5 drafts 6, 7, 8: 8 is past the row
    assert trained.int().tolist() == [[[0, 1, 1, 0], [0, 1, 1, 0]]]
    ones = torch.ones(1, 8, dtype=torch.long)
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]])
    trained = block_labels(ones, torch.tensor([[4]]), torch.tensor([[True]]), 4, docs)
    assert trained.int().tolist() == [[[0, 1, 0, 0]]]  # 5 is in the anchor's document, 6 and 7 are not
    gap_after = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 1]])  # the run after a gap is not the anchor's run
    assert block_labels(gap_after, torch.tensor([[1]]), torch.tensor([[True]]), 6).int().tolist() == \
        [[[0, 1, 0, 0, 0, 0]]]


def test_block_mask_keeps_a_packed_block_inside_its_document():
    docs = torch.tensor([[0, 0, 1, 1, 1]])
    mask = block_mask(torch.tensor([[4]]), seq_len=5, block_size=2, dtype=torch.float32, document_ids=docs)
    assert (mask[0, 0] == 0).int().tolist() == [[0, 0, 1, 1, 0, 1, 1], [0, 0, 1, 1, 0, 1, 1]]


def _layout_features(seq_len: int, vocab: int) -> DFlashFeatures:
    """Features whose target law at t is one-hot on token t + 1 (what the target predicts there)."""
    ids = torch.arange(seq_len)[None] % vocab
    probs = torch.zeros(1, seq_len, vocab)
    probs[0, torch.arange(seq_len), (torch.arange(seq_len) + 1) % vocab] = 1.0
    top1 = probs.argmax(-1)
    return DFlashFeatures(ids, torch.ones_like(ids), torch.zeros(1, seq_len, 4), embeds=torch.zeros(1, seq_len, 4),
                    targets=DraftTargets(probs, top1, torch.ones_like(top1, dtype=torch.bool)), top1=top1,
                    mask_embed=torch.zeros(4))


def test_block_slot_k_is_scored_against_token_anchor_plus_k(monkeypatch):
    """A stub head whose block slot k outputs one-hot(a + k) through an identity lm_head: every trained slot
    is correct only if slot k is scored against the target's law at a+k-1, the law of token a+k."""
    vocab, seq_len, bs = 32, 20, 4
    target = make_tiny_target("llama")
    head = build_head("dflash", target, block_size=bs, num_layers=1)
    objective = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash"]))

    def stub_outputs(head, features, anchors, context):
        tokens = anchors[..., None] + torch.arange(bs)  # (B, N, bs)
        return 50.0 * torch.nn.functional.one_hot(tokens % vocab, vocab).float()

    monkeypatch.setattr("draftsmith.train.objectives.dflash.block_outputs", stub_outputs)
    monkeypatch.setattr("draftsmith.train.objectives.dflash.sequence_context", lambda head, features: [])
    features = _layout_features(seq_len, vocab)
    objective.perturb(features, None, seed=0)
    out = objective(features, torch.nn.Identity())
    assert out.count.sum() > 0 and torch.equal(out.correct, out.count), (out.correct, out.count)
    assert float(out.loss) < 1e-6


def test_position_weights_are_the_papers_exponential_decay():
    assert default_gamma(16) == 7 and default_gamma(8) == 4
    target = make_tiny_target("llama", initializer_range=0.3)
    torch.manual_seed(0)
    head = build_head("dflash", target, block_size=16, num_layers=1)
    objective = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash"]))
    ids = torch.randint(3, 96, (2, 40))
    features = objective.features(target, {"input_ids": ids, "loss_mask": torch.ones_like(ids)}, head)
    out = objective(features, target.get_output_embeddings())
    by_hand = sum(math.exp(-(k - 1) / 7) * out.step_losses[k - 1] for k in range(1, 16))
    torch.testing.assert_close(out.loss.detach(), by_hand)
    set_gamma = objective_class("dflash", head.config.variant)(head, load_config(None, ["head.kind=dflash", "train.gamma=2.5"]))
    assert set_gamma.decay == pytest.approx(math.exp(-1 / 2.5))


def test_new_dflash_configs_take_the_authors_block_and_depth():
    head = build_head("dflash", make_tiny_target("llama", num_layers=8))
    assert head.config.block_size == 16 and head.config.num_layers == 5


def test_the_mask_token_must_be_an_ordinary_row_of_the_target():
    target = make_tiny_target("llama")  # pad 0, bos 1, eos 2, 96 rows
    check_mask_token(95, target)
    for mask_id, name in ((2, "eos_token"), (0, "pad_token"), (1, "bos_token")):
        with pytest.raises(ValueError, match=rf"head.mask_token_id={mask_id} is the target's {name}"):
            check_mask_token(mask_id, target)
    target.generation_config.eos_token_id = [2, 7]  # a chat model's second end-of-turn id
    with pytest.raises(ValueError, match="mask_token_id=7 is the target's eos_token"):
        check_mask_token(7, target)
    with pytest.raises(ValueError, match=r"mask_token_id=96 is not a row"):
        check_mask_token(96, target)

    class Tokenizer:  # 90 real ids: rows 90..95 are the embedding's padding
        pad_token_id = eos_token_id = bos_token_id = None

        def __len__(self):
            return 90

    with pytest.raises(ValueError, match="mask_token_id=93 is past the tokenizer's 90 ids"):
        check_mask_token(93, target, Tokenizer())


@pytest.mark.parametrize("mask_id, name", [(0, "pad_token"), (2, "eos_token")])
def test_a_saved_head_whose_mask_aliases_pad_or_eos_is_refused_where_it_loads(tmp_path, mask_id, name):
    """Training refuses such a mask; a head config saying it (edited, or made elsewhere) loaded and decoded
    without a word. Now every place that puts it beside a target refuses it: the generator, an export."""
    from draftsmith.heads import AutoHead
    from draftsmith.heads.formats import export_head
    from draftsmith.infer import SpeculativeGenerator

    target = make_tiny_target("qwen3")
    build_head("dflash", target, block_size=4, mask_token_id=mask_id).save_pretrained(tmp_path / "head")
    head = AutoHead.from_pretrained(tmp_path / "head")
    message = rf"head.mask_token_id={mask_id} is the target's {name}"
    with pytest.raises(ValueError, match=message):
        SpeculativeGenerator(target, head)
    with pytest.raises(ValueError, match=message):
        export_head(head, tmp_path / "export", "dflash", target=target.config)
    SpeculativeGenerator(target, build_head("dflash", target, block_size=4, mask_token_id=90))  # an ordinary row


def test_a_run_refuses_a_mask_token_that_aliases_eos(tiny_files, tmp_path):  # noqa: F811
    from support.train_fixtures import tiny_config
    from transformers import AutoTokenizer

    from draftsmith.train.run import setup

    eos = AutoTokenizer.from_pretrained(tiny_files["target"]).eos_token_id
    with pytest.raises(ValueError, match=rf"head.mask_token_id={eos} is the target's eos_token"):
        setup(tiny_config(tiny_files, tmp_path / "run", "head.kind=dflash", "head.block_size=4",
                          f"head.mask_token_id={eos}", "train.max_steps=1"))


def test_recipe_keys_are_checked_at_parse_time():
    cases = [(["head.kind=dflash", "train.loss_decay=0.5"], "train.loss_decay=0.5 is not read by head.kind=dflash"),
             (["head.kind=eagle3", "train.gamma=7"], "train.gamma applies only to head.kind=dflash"),
             (["head.kind=dflash", "train.gamma=0"], "train.gamma must be > 0"),
             (["head.kind=medusa", "train.loss=dpace"], "train.loss=dpace applies only to head.kind=eagle3/dflash"),
             (["head.kind=dflash", "train.dpace_alpha=0"], "train.dpace_alpha must lie in"),
             (["head.kind=dflash", "train.anchors_per_document=0"], "train.anchors_per_document must be >= 1"),
             (["head.kind=medusa", "train.stage=on-policy", "train.init_from=x"],
              "train.stage=on-policy applies only to head.kind=eagle3/dflash"),
             (["head.kind=dflash", "train.stage=on-policy"], "set train.init_from"),
             (["head.kind=dflash", "train.stage=on-policy", "train.init_from=x", "train.loss=dpace"],
              "train.loss=dpace must be ce")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)

