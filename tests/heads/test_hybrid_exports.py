"""Heads of a hybrid target (Qwen3.5: Gated DeltaNet layers, full attention every 4th) name the right layers:
the aux-layer defaults count every decoder layer whatever its kind, and every export format writes ids that
make each engine capture the states the head was trained on (test_formats' engine readers, on a hybrid)."""
from __future__ import annotations

import json

import pytest
import torch
from support.hybrids import make_tiny_hybrid
from support.formats import L, sglang_states, trtllm_states, vllm_states

from draftsmith.heads import build_head, default_aux_layer_ids
from draftsmith.heads.formats import FORMATS, export_head
from draftsmith.target.recurrent import layer_types

NAME = "org/tiny-qwen3.5"


@pytest.fixture(scope="module")
def target():
    model = make_tiny_hybrid("qwen3_5_text", num_layers=L)
    model.config._name_or_path = NAME
    assert layer_types(model) == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    return model


def _config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def _hidden(target):
    with torch.no_grad():
        hidden = target(torch.tensor([[1, 5, 9, 3, 7]]), output_hidden_states=True).hidden_states
    assert len(hidden) == L + 1  # the embeddings, then the state after each decoder layer of either kind
    return hidden


@pytest.mark.parametrize("aux", [None, [2, 4, 7]], ids=["default", "demo-hybrid.yaml"])
def test_eagle3_exports_of_a_hybrid_head_capture_its_training_layers(tmp_path, target, aux):
    head = build_head("eagle3", target, **({} if aux is None else {"aux_layer_ids": aux})).eval()
    want_ids = default_aux_layer_ids(L) if aux is None else aux
    assert list(head.config.aux_layer_ids) == want_ids == list(head.feature_layer_ids)
    assert head.config.target_num_layers == L
    hidden = _hidden(target)
    want = [hidden[k] for k in want_ids]
    formats = [f for f, record in FORMATS.items() if "eagle3" in record.kinds]
    assert formats == ["vllm", "sglang", "speculators"]
    for fmt in formats:
        out = export_head(head, tmp_path / fmt, fmt, target=target)
        config, card = _config(out), (out / "README.md").read_text()
        if fmt == "speculators":  # always written, HF convention
            assert config["eagle_aux_hidden_state_layer_ids"] == want_ids
            continue
        # vLLM/SGLang configs: written only when they differ from the engines' [2, L//2, L-3]
        assert config.get("eagle_aux_hidden_state_layer_ids", want_ids) == want_ids
        for got in (vllm_states(config, hidden), sglang_states(config, hidden), trtllm_states(card, hidden)):
            assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_dflash_exports_of_a_hybrid_head_name_its_context_layers(tmp_path, target):
    head = build_head("dflash", target, block_size=8, num_layers=2).eval()
    ids = list(head.config.aux_layer_ids)
    assert all(1 <= i < L for i in ids) and ids == list(head.feature_layer_ids)
    dflash = _config(export_head(head, tmp_path / "dflash", "dflash", target=target))
    spec = _config(export_head(head, tmp_path / "spec", "speculators", target=target))
    # z-lab's layout and speculators' dflash_config count "output of layer k" (= hidden_states[k + 1])
    assert dflash["dflash_config"]["target_layer_ids"] == [i - 1 for i in ids]
    assert spec["aux_hidden_state_layer_ids"] == ids
