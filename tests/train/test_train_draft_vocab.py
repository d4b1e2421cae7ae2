"""Draft vocabulary selection on hand-made frequency tables, caching and coverage; the share of the target's law
inside the draft vocabulary, by hand and as the evaluation reports it."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)
from transformers import AutoModelForCausalLM

from draftsmith.heads import build_head
from draftsmith.train.draft_vocab import build_draft_vocab, coverage, select_draft_vocab, token_counts
from draftsmith.train.evaluation import evaluate
from draftsmith.train.losses import restrict_to_draft_vocab


def test_select_most_frequent_sorted_by_id():
    counts = torch.tensor([5, 0, 9, 1, 9, 3, 0, 7])
    ids = select_draft_vocab(counts, 4)
    assert ids.tolist() == [0, 2, 4, 7]  # counts 5, 9, 9, 7: the top four, in id order


def test_select_breaks_ties_by_lower_id():
    counts = torch.tensor([1, 2, 2, 2, 0])
    assert select_draft_vocab(counts, 2).tolist() == [1, 2]
    assert select_draft_vocab(counts, 5).tolist() == [0, 1, 2, 3, 4]  # the whole vocab
    with pytest.raises(ValueError, match="draft vocab size 6"):
        select_draft_vocab(counts, 6)


def test_token_counts_only_loss_masked_positions():
    rows = [
        {"input_ids": [1, 2, 3, 3], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [3, 4, 4], "loss_mask": [1, 0, 1]},
    ]
    assert token_counts(rows, vocab_size=6).tolist() == [0, 0, 1, 3, 1, 0]
    with pytest.raises(ValueError, match="outside the target vocabulary of 4"):
        token_counts(rows, vocab_size=4)


def test_token_counts_reads_a_datasets_table():
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 3], [3, 4, 4]],
                                        "loss_mask": [[0, 1, 1, 1], [1, 0, 1]]})
    assert token_counts(table, vocab_size=6).tolist() == [0, 0, 1, 3, 1, 0]


def test_build_is_cached_by_key(tmp_path):
    rows = [{"input_ids": [7, 7, 7, 1, 2, 2], "loss_mask": [1, 1, 1, 1, 1, 0]}]
    first = build_draft_vocab(rows, vocab_size=8, size=2, data_key="abc", cache_dir=tmp_path)
    assert first.ids.tolist() == [1, 7] and not first.cache_hit
    assert first.coverage == pytest.approx(4 / 5)  # 7,7,7,1 of the five masked tokens
    again = build_draft_vocab([], vocab_size=8, size=2, data_key="abc", cache_dir=tmp_path)
    assert again.cache_hit and torch.equal(again.ids, first.ids)
    assert json.loads(open(again.cache_path).read())["data_key"] == "abc"
    other = build_draft_vocab(rows, vocab_size=8, size=3, data_key="abc", cache_dir=tmp_path)
    assert not other.cache_hit and other.ids.tolist() == [1, 2, 7]
    with pytest.raises(ValueError, match="no loss-masked tokens"):
        build_draft_vocab([{"input_ids": [1], "loss_mask": [0]}], vocab_size=8, size=2, data_key="z",
                          cache_dir=tmp_path)


def test_coverage():
    ids = torch.tensor([1, 4, 6])
    assert coverage(ids, torch.tensor([[1, 2], [4, 4]])) == pytest.approx(0.75)


@pytest.mark.parametrize("damage", ['{"ids": [1, ', '{"ids": [7, 1], "coverage": 0.5}', '{"ids": [1, 9], "coverage": 0.5}',
                                    '{"ids": [1, 7]}', '[1, 7]'])
def test_a_damaged_cached_vocab_is_named_and_chosen_again(tmp_path, caplog, damage):
    """A cut cached selection was json's 'Expecting ...' error, naming no file; an edited one was used."""
    rows = [{"input_ids": [1, 7, 7, 2], "loss_mask": [1, 1, 1, 0]}]
    first = build_draft_vocab(rows, vocab_size=8, size=2, data_key="abc", cache_dir=tmp_path)
    Path(first.cache_path).write_text(damage)
    with caplog.at_level(logging.WARNING, logger="draftsmith.train"):
        again = build_draft_vocab(rows, vocab_size=8, size=2, data_key="abc", cache_dir=tmp_path)
    assert not again.cache_hit and again.ids.tolist() == [1, 7] and again.coverage == first.coverage
    assert f"the cached draft vocabulary {first.cache_path} is damaged" in caplog.text
    assert build_draft_vocab([], vocab_size=8, size=2, data_key="abc", cache_dir=tmp_path).cache_hit


def test_the_laws_mass_inside_the_draft_vocab_by_hand():
    t2d = torch.tensor([True, False, True, True, False])
    logits = torch.tensor([[[1.0, 5.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0, 0.0]]])
    e = math.exp  # row 0 keeps ids 0, 2, 3 and loses 1 (its top-1) and 4; row 1 keeps its top-1
    expected = [(e(1) + e(2) + 1) / (e(1) + e(5) + e(2) + 2), (e(3) + e(1) + 1) / (e(3) + e(1) + 3)]
    torch.testing.assert_close(restrict_to_draft_vocab(logits, t2d).mass[0], torch.tensor(expected))
    assert torch.equal(restrict_to_draft_vocab(logits, None).mass, torch.ones(1, 2))


def test_the_laws_mass_of_bf16_logits_is_a_float_sum():
    """bf16 logits as a GPU target gives them, near 10 over 4,096 ids: a bf16 logsumexp (its step 1/16 there)
    would put the mass off by percents."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 300, 4096, generator=g) * 3 + 10).bfloat16()
    t2d = torch.zeros(4096, dtype=torch.bool)
    t2d[torch.randperm(4096, generator=g)[:1024]] = True
    exact = logits.double().softmax(-1)[..., t2d].sum(-1)  # 600 positions: more than one chunk of 256
    torch.testing.assert_close(restrict_to_draft_vocab(logits, t2d).mass.double(), exact, atol=1e-5, rtol=1e-5)


def test_evaluation_reports_the_laws_mean_mass_over_the_trained_positions(tiny_files, tmp_path):
    cfg = tiny_config(tiny_files, tmp_path / "run", "head.kind=eagle3", "head.ttt_steps=2")
    target = AutoModelForCausalLM.from_pretrained(tiny_files["target"]).eval()
    head = build_head("eagle3", target, draft_vocab_size=64)
    head.set_draft_vocab(list(range(0, 256, 4)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 290, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a prompt: its positions predict no trained token
    mask[1, 9:] = 0  # padding
    metrics = evaluate(Accelerator(cpu=True), head, target, [{"input_ids": ids, "loss_mask": mask}], cfg, 2)
    with torch.no_grad():
        law = target(ids).logits.double().softmax(-1)
    inside = law[..., head.t2d.bool()].sum(-1)[:, :-1]  # position j's law is the next token's, j + 1
    expected = inside[mask[:, 1:].bool()].mean().item()
    assert 0.05 < expected < 0.95
    assert metrics["draft_vocab_mass"] == pytest.approx(expected, rel=1e-5)
