"""DFlash heads exported in z-lab's ``DFlashDraftModel`` layout (format ``dflash``: SGLang's DFLASH and
z-lab's code) and imported back, from our exports and from a checkpoint written the way z-lab's
published drafters are (Qwen3 config with rope_theta only, no provenance): exact tensors, the same
drafts, validated like every export."""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from safetensors.torch import load_file, save_file
from support.formats import perturb

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head, import_dflash, validate_export
from draftsmith.infer import Chain, SpeculativeGenerator
from draftsmith.scripts.export import cli as export_cli

L = 8


@pytest.fixture(scope="module")
def target():
    model = make_tiny_target("qwen3", num_layers=L)
    model.config._name_or_path = "org/tiny-qwen3"
    return model


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    return perturb(build_head("dflash", target, num_layers=2, block_size=4, mask_token_id=90))


def test_export_writes_zlab_layout(tmp_path, target, head):
    out = export_head(head, tmp_path / "d", "dflash", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4 and config["num_target_layers"] == L
    # draftsmith's HF indices (state entering layer k) minus 1 = DFlash's "output of layer k"
    assert config["dflash_config"] == {"target_layer_ids": [i - 1 for i in head.config.aux_layer_ids],
                                       "mask_token_id": 90}
    tensors = load_file(out / "model.safetensors")
    assert tensors.keys() == head.state_dict().keys()
    assert "layers.1.self_attn.q_norm.weight" in tensors and "embed_tokens.weight" not in tensors
    assert "--speculative-algorithm DFLASH" in (out / "README.md").read_text()


def _drafts(head, target, prompt):
    gen = SpeculativeGenerator(target, head, tree=Chain(3))
    out = gen.generate(prompt, max_new_tokens=16)
    return out, gen.last_stats.tau


def test_export_import_round_trip_is_exact(tmp_path, target, head):
    out = export_head(head, tmp_path / "d", "dflash", target=target)
    for back in (import_dflash(out), AutoHead.from_pretrained(out)):
        a, b = head.state_dict(), back.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert (back.config.block_size, back.config.num_layers, back.config.mask_token_id) == (4, 2, 90)
        assert back.config.aux_layer_ids == head.config.aux_layer_ids
        back.check_target(target)
        prompt = torch.randint(3, 90, (1, 7))
        (out_a, tau_a), (out_b, tau_b) = _drafts(back, target, prompt), _drafts(head, target, prompt)
        assert torch.equal(out_a, out_b) and tau_a == tau_b  # same output, same acceptance


def _as_zlab(out):
    """Rewrite our export as z-lab publishes its drafters: transformers-4 rope fields, no provenance,
    auto_map to their code."""
    config = json.loads((out / "config.json").read_text())
    for key in ("rope_parameters", "draftsmith", "dtype"):
        config.pop(key, None)
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (out / "config.json").write_text(json.dumps(config))
    return config


def test_a_zlab_style_checkpoint_imports(tmp_path, target, head):
    out = export_head(head, tmp_path / "d", "dflash", target=target)
    _as_zlab(out)
    back = AutoHead.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
    back.check_target(target)


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: c["dflash_config"].pop("mask_token_id"), "names no mask_token_id"),
    (lambda c, t: c["dflash_config"].update(target_layer_ids=[3, L]), r"target_layer_ids=\[3, 8\] must lie in 0\.\.7"),
    (lambda c, t: t.pop("layers.1.self_attn.k_norm.weight"), r"missing tensors \['layers\.1\.self_attn\.k_norm"),
    (lambda c, t: t.update({"fc.weight": torch.zeros(32, 96)}), r"fc\.weight: shape \(32, 96\)"),
    (lambda c, t: c.update(block_size=1), "block_size=1"),
])
def test_bad_checkpoints_are_refused_by_name(tmp_path, target, head, edit, message):
    out = export_head(head, tmp_path / "d", "dflash", target=target)
    config = _as_zlab(out)
    tensors = load_file(out / "model.safetensors")
    edit(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        import_dflash(out)


def test_validate_export_and_cli(tmp_path, target, head):
    head_dir = tmp_path / "head"
    head.save_pretrained(head_dir)
    assert export_cli(["--head", str(head_dir), "--to", "dflash", "--out", str(tmp_path / "x")]) == 0
    validate_export(tmp_path / "x", "dflash")
    tensors = load_file(tmp_path / "x" / "model.safetensors")
    tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:, :-1].contiguous()
    save_file(tensors, tmp_path / "x" / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.weight: shape"):
        validate_export(tmp_path / "x", "dflash")
    with pytest.raises(ValueError, match="format 'dflash' exports dflash heads, got a eagle3 head"):
        export_head(build_head("eagle3", target), tmp_path / "y", "dflash", target=target)


# ------------------------------------------------------------------ speculators' dflash type (--to speculators)


def test_speculators_export_writes_the_libraries_dflash_config(tmp_path, target, head):
    """The fields the speculators library's DFlashSpeculatorConfig and vLLM's update_dflash read."""
    out = export_head(head, tmp_path / "s", "speculators", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["hidden_size"] == target.config.hidden_size
    assert (config["block_size"], config["mask_token_id"], config["draft_vocab_size"]) == (4, 90, layer["vocab_size"])
    # HF indices (vLLM passes i - 1 to the model as dflash_config.target_layer_ids)
    assert config["aux_hidden_state_layer_ids"] == list(head.config.aux_layer_ids)
    assert config["sample_from_anchor"] is False
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["proposal_methods"] == [{"proposal_type": "greedy",
                                                                          "speculative_tokens": 3}]
    assert spec["verifier"]["name_or_path"] == "org/tiny-qwen3"
    assert load_file(out / "model.safetensors").keys() == head.state_dict().keys()
    assert "vllm serve" in (out / "README.md").read_text()


def test_speculators_round_trip_is_exact_and_drafts_alike(tmp_path, target, head):
    out = export_head(head, tmp_path / "s", "speculators", target=target)
    back = AutoHead.from_pretrained(out)
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.config.aux_layer_ids == head.config.aux_layer_ids and back.config.target_num_layers == L
    back.check_target(target)
    prompt = torch.randint(3, 90, (1, 7))
    (out_a, tau_a), (out_b, tau_b) = _drafts(back, target, prompt), _drafts(head, target, prompt)
    assert torch.equal(out_a, out_b) and tau_a == tau_b


def test_a_speculators_library_checkpoint_imports(tmp_path, target, head):
    """As the library saves one: no draftsmith provenance, copies of the verifier's embedding and
    lm_head beside the draft's tensors (dropped on import)."""
    out = export_head(head, tmp_path / "s", "speculators", target=target)
    config = json.loads((out / "config.json").read_text())
    config.pop("draftsmith")
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    save_file(tensors, out / "model.safetensors")
    back = AutoHead.from_pretrained(out)
    assert back.config.target_num_layers is None  # the library records no target depth
    assert all(torch.equal(head.state_dict()[k], v) for k, v in back.state_dict().items())


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: c.update(aux_hidden_state_layer_ids=[0, 3]), r"target_layer_ids=\[-1, 2\] must lie in 0"),
    (lambda c, t: c.update(mask_token_id=None), "mask_token_id=None must be a token id"),
    (lambda c, t: c.update(sample_from_anchor=True), "sample_from_anchor=true"),
    (lambda c, t: c.update(draft_vocab_size=32), "draft_vocab_size=32 differs"),
    (lambda c, t: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=9),
     "speculative_tokens=9 exceeds block_size - 1 = 3"),
    (lambda c, t: c["speculators_config"]["verifier"].update(name_or_path=""), "verifier.name_or_path is empty"),
    (lambda c, t: c.pop("transformer_layer_config"), "transformer_layer_config is missing"),
    (lambda c, t: t.pop("hidden_norm.weight"), r"missing tensors \['hidden_norm\.weight'\]"),
])
def test_bad_speculators_checkpoints_are_refused_by_name(tmp_path, target, head, edit, message):
    out = export_head(head, tmp_path / "s", "speculators", target=target)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    edit(config, tensors)
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        AutoHead.from_pretrained(out)
    with pytest.raises(ValueError, match=message):
        validate_export(out, "speculators")


def test_speculators_export_cli_and_kinds(tmp_path, target, head):
    head_dir = tmp_path / "head"
    head.save_pretrained(head_dir)
    assert export_cli(["--head", str(head_dir), "--to", "speculators", "--out", str(tmp_path / "x")]) == 0
    validate_export(tmp_path / "x", "speculators")
    assert json.loads((tmp_path / "x" / "config.json").read_text())["speculators_model_type"] == "dflash"
    with pytest.raises(ValueError, match="format 'speculators' exports eagle3 and dflash heads, got a medusa head"):
        export_head(build_head("medusa", target), tmp_path / "y", "speculators", target=target)
