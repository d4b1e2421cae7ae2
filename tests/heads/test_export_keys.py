"""One test per row of docs/export-keys.md: the key each engine's reader takes, as our exports write it.
The table's `row` ids and ``ROWS`` must name the same rows, so a row added to the page needs its test."""
from __future__ import annotations

import json
import re

import pytest
import torch
from support.targets import make_tiny_target
from safetensors.torch import load_file
from support.formats import perturb
from support.mtp_targets import make_mtp_target

from draftsmith.heads import build_head
from draftsmith.heads.formats import export_head
from support.house import REPO

DOC = REPO / "docs" / "export-keys.md"
ABSENT = object()  # the key is not written: the reader's default applies
L = 8

# row -> (export, key path in config.json, what we write)
ROWS = {
    "spec-eagle3/speculators_model_type": ("spec-eagle3", "speculators_model_type", "eagle3"),
    "spec-eagle3/transformer_layer_config": ("spec-eagle3", "transformer_layer_config.model_type", "llama"),
    "spec-eagle3/speculative_tokens": ("spec-eagle3", "speculators_config.proposal_methods.0.speculative_tokens", 3),
    "spec-eagle3/verifier": ("spec-eagle3", "speculators_config.verifier.name_or_path", "org/tiny"),
    "spec-eagle3/draft_vocab_size": ("spec-eagle3", "draft_vocab_size", 96),
    "spec-eagle3/target_hidden_size": ("spec-eagle3", "target_hidden_size", 32),
    "spec-eagle3/norm_before_residual": ("spec-eagle3", "norm_before_residual", False),
    "spec-eagle3/norm_before_fc": ("spec-eagle3", "norm_before_fc", False),
    "spec-eagle3/fc_norm": ("spec-eagle3", "fc_norm", True),
    "spec-eagle3/norm_output": ("spec-eagle3", "norm_output", True),
    "spec-eagle3/aux_layer_ids": ("spec-eagle3", "eagle_aux_hidden_state_layer_ids", [1, 4, 6]),
    "spec-dflash/speculators_model_type": ("spec-dflash", "speculators_model_type", "dflash"),
    "spec-dflash/draft_vocab_size": ("spec-dflash", "draft_vocab_size", 96),
    "spec-dflash/target_hidden_size": ("spec-dflash", "target_hidden_size", 32),
    "spec-dflash/aux_layer_ids": ("spec-dflash", "aux_hidden_state_layer_ids", "head.aux_layer_ids"),
    "spec-dflash/mask_token_id": ("spec-dflash", "mask_token_id", 90),
    "spec-dflash/sliding_window_non_causal": ("spec-dflash", "sliding_window_non_causal", True),
    "spec-dflash/speculative_tokens": ("spec-dflash", "speculators_config.proposal_methods.0.speculative_tokens", 3),
    "spec-dflash/dflash_causal": ("spec-dflash", "dflash_config", ABSENT),  # update_dflash derives it
    "dflash/is_causal": ("dflash", "is_causal", ABSENT),
    "dflash/dflash_causal": ("dflash", "dflash_config.causal", ABSENT),
    "dflash/layer_types": ("dflash", "layer_types", ["full_attention"] * 2),
    "dflash/use_swa": ("dflash", "dflash_config.use_swa", ABSENT),
    "dflash/target_hidden_size": ("dflash", "target_hidden_size", ABSENT),
    "vllm/attention_bias": ("vllm", "attention_bias", False),
    "vllm/norm_before_residual": ("vllm", "norm_before_residual", False),
    "vllm/use_aux_hidden_state": ("vllm", "eagle_config.use_aux_hidden_state", True),
    "vllm/norm_before_fc": ("vllm", "norm_before_fc", ABSENT),
    "vllm/num_aux_hidden_states": ("vllm", "num_aux_hidden_states", ABSENT),
    "vllm/target_hidden_size": ("vllm", "target_hidden_size", 32),
    "vllm/fc_norm": ("vllm-plain", "fc_norm", False),
    "vllm/norm_output": ("vllm-plain", "norm_output", ABSENT),
    "vllm/draft_vocab_size": ("vllm", "draft_vocab_size", 96),
    "vllm/logit_scale": ("vllm", "logit_scale", ABSENT),
    "vllm/layer_name": ("vllm", "tensors:midlayer.hidden_norm.weight", "present"),
    "sglang/num_hidden_layers": ("vllm", "num_hidden_layers", 1),
    "sglang/intermediate_size": ("vllm", "intermediate_size", "head.intermediate_size"),
    "sglang/model_type": ("vllm", "model_type", "llama"),
    "sglang/mrope": ("vllm", "rope_scaling", None),
    "sglang/target_hidden_size": ("vllm", "target_hidden_size", 32),
    "sglang/fc_bias": ("vllm", "bias", ABSENT),
    "sglang/tie_word_embeddings": ("vllm", "tie_word_embeddings", False),
    "sglang/draft_vocab_size": ("vllm", "draft_vocab_size", 96),
    "sglang/aux_layer_ids": ("vllm", "eagle_config.eagle_aux_hidden_state_layer_ids", [0, 3, 5]),
    "spec-peagle/speculators_model_type": ("spec-peagle", "speculators_model_type", "peagle"),
    "spec-peagle/architectures": ("spec-peagle", "architectures", ["PEagleSpeculator"]),
    "spec-peagle/mask_token_id": ("spec-peagle", "mask_token_id", 95),
    "spec-peagle/norm_before_residual": ("spec-peagle", "norm_before_residual", False),
    "spec-peagle/fc_norm": ("spec-peagle", "fc_norm", False),
    "spec-peagle/algorithm": ("spec-peagle", "speculators_config.algorithm", "peagle"),
    "spec-peagle/speculative_tokens": ("spec-peagle", "speculators_config.proposal_methods.0.speculative_tokens", 3),
    "spec-peagle/aux_layer_ids": ("spec-peagle", "eagle_aux_hidden_state_layer_ids", "head.aux_layer_ids"),
    "spec-peagle/mask_hidden": ("spec-peagle", "tensors:mask_hidden", "present"),
    "spec-peagle/embed_tokens": ("spec-peagle", "tensors:embed_tokens.weight", "the target's, the mask row the head's"),
    "lib-eagle3/embed_tokens": ("spec-eagle3", "tensors:embed_tokens.weight", "the target's"),
    "lib-eagle3/norm_output": ("spec-eagle3-plain", "norm_output", False),
    "lib-eagle3/fc_norm": ("spec-eagle3-plain", "fc_norm", False),
    "lib-dflash/sliding_window_non_causal": ("spec-dflash", "sliding_window_non_causal", True),
    "lib-dflash/verifier_weights": ("spec-dflash", "tensors:embed_tokens.weight", ABSENT),
    "spec-dspark/speculators_model_type": ("spec-dspark", "speculators_model_type", "dspark"),
    "spec-dspark/sample_from_anchor": ("spec-dspark", "sample_from_anchor", True),
    "spec-dspark/markov_rank": ("spec-dspark", "markov_rank", 8),
    "spec-dspark/markov_head_type": ("spec-dspark", "markov_head_type", "vanilla"),
    "spec-dspark/speculative_tokens": ("spec-dspark", "speculators_config.proposal_methods.0.speculative_tokens", 4),
    "spec-dspark/enable_confidence_head": ("spec-dspark", "transformer_layer_config.enable_confidence_head", True),
    "spec-dspark/confidence_head_with_markov": ("spec-dspark", "transformer_layer_config.confidence_head_with_markov",
                                                True),
    "spec-dspark/markov_head": ("spec-dspark", "tensors:markov_head.markov_w2.weight", "present"),
    "spec-dspark/confidence_bias": ("spec-dspark", "tensors:confidence_head.proj.bias", "present"),
    "dspark/architectures": ("dspark", "architectures", ["Qwen3DSparkModel"]),
    "dspark/target_layer_ids": ("dspark", "target_layer_ids", "head.aux_layer_ids - 1"),
    "dspark/head_dim": ("dspark", "head_dim", 8),
    "dspark/block_size": ("dspark", "block_size", 4),
    "dspark/mask_token_id": ("dspark", "mask_token_id", 90),
    "dspark/markov_rank": ("dspark", "markov_rank", 8),
    "dspark/enable_confidence_head": ("dspark", "enable_confidence_head", True),
    "dspark/confidence_head_with_markov": ("dspark", "confidence_head_with_markov", True),
    "dspark/embed_tokens": ("dspark", "tensors:embed_tokens.weight", "the target's"),
    "dspark/lm_head": ("dspark", "tensors:lm_head.weight", "present"),
    "dspark/norm": ("dspark", "tensors:norm.weight", "present"),
    "domino/architectures": ("domino", "architectures", ["DominoDraftModel"]),
    "domino/projector_type": ("domino", "dflash_config.projector_type", "domino"),
    "domino/gru_hidden_dim": ("domino", "dflash_config.gru_hidden_dim", 8),
    "domino/emb_dim": ("domino", "dflash_config.emb_dim", 6),
    "domino/pure_draft_prefix_len": ("domino", "dflash_config.pure_draft_prefix_len", 1),
    "domino/shift_label": ("domino", "dflash_config.shift_label", True),
    "domino/prefix_gru": ("domino", "tensors:prefix_gru.weight_hh_l0", "present"),
    "domino/embed_proj": ("domino", "tensors:embed_proj.2.weight", "present"),
    "mtp/architectures": ("mtp-deepseek", "architectures", ["DraftsmithMtpLayers"]),
    "mtp/mtp_layout": ("mtp-qwen", "mtp_layout", "qwen3_next"),
    "mtp/target_num_hidden_layers": ("mtp-deepseek", "target_num_hidden_layers", 2),
    "mtp/num_mtp_layers": ("mtp-deepseek", "num_mtp_layers", 1),
    "mtp-deepseek/enorm": ("mtp-deepseek", "tensors:model.layers.2.enorm.weight", "present"),
    "mtp-deepseek/hnorm": ("mtp-deepseek", "tensors:model.layers.2.hnorm.weight", "present"),
    "mtp-deepseek/eh_proj": ("mtp-deepseek", "tensors:model.layers.2.eh_proj.weight", "present"),
    "mtp-deepseek/shared_head_norm": ("mtp-deepseek", "tensors:model.layers.2.shared_head.norm.weight", "present"),
    "mtp-deepseek/mtp_block": ("mtp-deepseek", "tensors:model.layers.2.self_attn.kv_a_proj_with_mqa.weight", "present"),
    "mtp-deepseek/experts": ("mtp-deepseek", "tensors:model.layers.2.mlp.experts.0.gate_proj.weight", "present"),
    "mtp-deepseek/embed_tokens": ("mtp-deepseek", "tensors:model.layers.2.embed_tokens.weight", "the target's"),
    "mtp-deepseek/shared_head_head": ("mtp-deepseek", "tensors:model.layers.2.shared_head.head.weight",
                                      "the target's lm_head"),
    "mtp-qwen/fc": ("mtp-qwen", "tensors:mtp.fc.weight", "present"),
    "mtp-qwen/pre_fc_norm_embedding": ("mtp-qwen", "tensors:mtp.pre_fc_norm_embedding.weight", "present"),
    "mtp-qwen/pre_fc_norm_hidden": ("mtp-qwen", "tensors:mtp.pre_fc_norm_hidden.weight", "present"),
    "mtp-qwen/norm": ("mtp-qwen", "tensors:mtp.norm.weight", "present"),
    "mtp-qwen/layers": ("mtp-qwen", "tensors:mtp.layers.0.mlp.experts.0.gate_proj.weight", "present"),
    "mtp-qwen/embed_tokens": ("mtp-qwen", "tensors:mtp.embed_tokens.weight", ABSENT),
    "mtp-qwen/lm_head": ("mtp-qwen", "tensors:lm_head.weight", ABSENT),
}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Every export the rows read: (config, tensors, head, target) by name."""
    root = tmp_path_factory.mktemp("exports")
    llama, qwen = make_tiny_target("llama", num_layers=L), make_tiny_target("qwen3", num_layers=L)
    llama.config._name_or_path = qwen.config._name_or_path = "org/tiny"
    flagged = perturb(build_head("eagle3", llama, aux_layer_ids=[1, 4, 6], fc_norm=True, norm_output=True))
    plain = perturb(build_head("eagle3", llama))
    dflash = perturb(build_head("dflash", qwen, num_layers=2, block_size=4, mask_token_id=90))
    dspark = perturb(build_head("dflash", qwen, num_layers=2, block_size=4, mask_token_id=90, variant="dspark",
                                 markov_rank=8))
    peagle = perturb(build_head("eagle3", llama, variant="peagle", num_depths=4))
    domino = perturb(build_head("dflash", qwen, num_layers=2, block_size=4, mask_token_id=90, variant="domino",
                                 gru_hidden_dim=8, emb_dim=6))
    made = {"domino": (domino, "dflash", qwen), "spec-peagle": (peagle, "speculators", llama), "spec-dspark": (dspark, "speculators", qwen), "dspark": (dspark, "dspark", qwen), "vllm": (flagged, "vllm", llama), "vllm-plain": (plain, "vllm", llama),
            "spec-eagle3": (flagged, "speculators", llama), "spec-eagle3-plain": (plain, "speculators", llama),
            "spec-dflash": (dflash, "speculators", qwen), "dflash": (dflash, "dflash", qwen)}
    for style, name in (("deepseek", "mtp-deepseek"), ("qwen3_next", "mtp-qwen")):  # the target's own MTP layers
        mtp = make_mtp_target(style, root / f"{style}-target").model
        made[name] = (perturb(build_head("mtp", mtp)), "mtp", mtp)
    out = {}
    for name, (head, fmt, target) in made.items():
        path = export_head(head, root / name, fmt, target=target)
        config = json.loads((path / "config.json").read_text())
        out[name] = (config, load_file(path / "model.safetensors"), head, target)
    return out


def _value(config: dict, path: str):
    for part in path.split("."):
        if isinstance(config, list):
            config = config[int(part)]
        elif isinstance(config, dict) and part in config:
            config = config[part]
        else:
            return ABSENT
    return config


@pytest.mark.parametrize("row", sorted(ROWS))
def test_export_writes_what_the_reader_takes(exports, row):
    name, path, want = ROWS[row]
    config, tensors, head, target = exports[name]
    if path.startswith("tensors:"):
        tensor = tensors.get(path.removeprefix("tensors:"))
        if want is ABSENT:
            assert tensor is None
        elif want == "the target's":
            assert torch.equal(tensor, target.get_input_embeddings().weight)
        elif want == "the target's lm_head":
            assert torch.equal(tensor, target.get_output_embeddings().weight)
        elif want == "the target's, the mask row the head's":
            mask = head.config.mask_token_id
            assert torch.equal(tensor[mask], head.mask_embedding)
            assert torch.equal(tensor[:mask], target.get_input_embeddings().weight[:mask])
        else:
            assert tensor is not None
        return
    if want == "head.aux_layer_ids - 1":
        want = [i - 1 for i in head.config.aux_layer_ids]
    if isinstance(want, str) and want.startswith("head."):  # the head's own value of that setting
        want = getattr(head.config, want.removeprefix("head."))
        want = list(want) if isinstance(want, (list, tuple)) else want
    if path == "dflash_config":  # the speculators config has none of its own: vLLM's reader builds it
        assert _value(config, path) is ABSENT and _value(config, "sliding_window_non_causal") is True
        return
    assert _value(config, path) == want if want is not ABSENT else _value(config, path) is ABSENT


def test_every_row_of_the_page_has_its_test():
    rows = set(re.findall(r"^\| `([a-z0-9-]+/[a-z_0-9]+)` \|", DOC.read_text(), flags=re.M))
    assert rows == set(ROWS)


def row_checks_its_own_key(row: str, path: str, doc: str) -> bool:
    """The row's test reads a key the page's row names (its "key" column): a row whose test checks another
    field (``sglang/intermediate_size`` once checked ``model_type``) proves nothing about its own."""
    column = re.search(rf"^\| `{re.escape(row)}` \| ([^|]*) \|", doc, flags=re.M).group(1)
    parts = [p for p in path.removeprefix("tensors:").split(".") if not p.isdigit()]
    return any(f"`{p}" in column or f"{p}`" in column or f"`{p}." in column for p in parts)


def test_every_row_s_test_reads_its_own_key():
    doc = DOC.read_text()
    assert [row for row, (_, path, _) in ROWS.items() if not row_checks_its_own_key(row, path, doc)] == []
    assert not row_checks_its_own_key("sglang/intermediate_size", "model_type", doc)  # what its test read before


@pytest.mark.parametrize("fmt", ["vllm", "speculators", "dflash", "dspark", "eagle-vllm", "medusa-vllm", "medusa-tgi"])
def test_every_readme_says_what_it_was_checked_against(tmp_path, fmt):
    target = make_tiny_target("qwen3" if fmt in ("dflash", "dspark") else "llama", num_layers=L)
    target.config._name_or_path = "org/tiny"
    kind = {"vllm": "eagle3", "speculators": "eagle3", "dflash": "dflash", "dspark": "dflash",
            "eagle-vllm": "eagle"}.get(fmt, "medusa")
    extra = {"dflash": {"mask_token_id": 90, "block_size": 4}}.get(kind, {}) | (
        {"variant": "dspark"} if fmt == "dspark" else {})
    out = export_head(build_head(kind, target, **extra), tmp_path / fmt, fmt, target=target)
    section = (out / "README.md").read_text().split("## Checked against\n\n")[1]
    how = {"speculators": "speculators 0.9.0: loaded with its own `from_pretrained`",
           "vllm": "docs/export-keys.md", "dflash": "docs/export-keys.md",
           "dspark": "SGLang's `qwen3_dspark.py` loader"}.get(fmt, "not run here")
    assert section.startswith("- ") and how in section
