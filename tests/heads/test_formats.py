"""Serving formats: per-format conformance, layer-id conventions as each engine reads them, refusals,
tampered directories, EAGLE-3 import (ours and public layouts) and export -> import round trips."""
from __future__ import annotations

import copy

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from support.targets import make_tiny_target
from support.formats import H, INTER, L, V, perturb, sglang_states, trtllm_states, vllm_states
from support.reference import hf_greedy
from draftsmith.heads import AutoHead, Eagle3Head, build_head, default_aux_layer_ids
from draftsmith.heads.formats import (
    EXPORT_MARKER,
    FORMATS,
    aux_layer_ids_from_config,
    export_head,
    import_eagle3,
    validate_export,
)
from support.house import REPO

NH, NKV, HD = 4, 2, 8
VD = 40
NAME = "org/tiny-llama"
DRAFT_IDS = torch.arange(0, 2 * VD, 2)  # a reduced draft vocabulary: every second target id


@pytest.fixture(scope="module")
def target():
    model = make_tiny_target("llama", num_layers=L)
    model.config._name_or_path = NAME
    return model


@pytest.fixture(scope="module")
def eagle3_reduced(target):
    head = build_head("eagle3", target, draft_vocab_size=VD)
    head.set_draft_vocab(DRAFT_IDS)
    return perturb(head)


@pytest.fixture(scope="module")
def eagle3_custom(target):
    return perturb(build_head("eagle3", target, aux_layer_ids=[1, 4, 6]))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _midlayer_spec(prefix: str, attn_in: int) -> dict[str, tuple]:
    return {
        f"{prefix}self_attn.q_proj.weight": (NH * HD, attn_in), f"{prefix}self_attn.k_proj.weight": (NKV * HD, attn_in),
        f"{prefix}self_attn.v_proj.weight": (NKV * HD, attn_in), f"{prefix}self_attn.o_proj.weight": (H, NH * HD),
        f"{prefix}mlp.gate_proj.weight": (INTER, H), f"{prefix}mlp.up_proj.weight": (INTER, H),
        f"{prefix}mlp.down_proj.weight": (H, INTER), f"{prefix}post_attention_layernorm.weight": (H,),
    }


# --------------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("reduced", [True, False])
def test_eagle3_export_matches_reference_layout(tmp_path, target, eagle3_reduced, eagle3_custom, fmt, reduced):
    head = eagle3_reduced if reduced else eagle3_custom
    out = export_head(head, tmp_path / "out", fmt, target=target)
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "README.md", "config.json", "model.safetensors"]
    tensors = _tensors(out / "model.safetensors")
    layer = "layers.0." if fmt == "speculators" else "midlayer."  # speculators' Eagle3DraftModel: layers[0]
    expected = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD if reduced else V, H),
                f"{layer}input_layernorm.weight": (H,), f"{layer}hidden_norm.weight": (H,),
                **_midlayer_spec(layer, 2 * H)}
    if reduced:
        expected.update({"d2t": (VD,), "t2d": (V,)})
    if fmt == "speculators":  # the target's embedding: the library leaves its own uninitialised otherwise
        expected["embed_tokens.weight"] = (V, H)
        assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected  # exact key set: no model. prefix
    state = {k.replace("midlayer.", layer): v for k, v in head.state_dict().items()}
    assert all(torch.equal(tensors[k], state[k]) for k in expected if k in state)
    if reduced:
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        assert torch.equal(torch.arange(VD) + tensors["d2t"], DRAFT_IDS) and int(tensors["t2d"].sum()) == VD
    config = _config(out)
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["hidden_size"], layer["intermediate_size"], layer["num_attention_heads"],
            layer["num_key_value_heads"], layer["head_dim"], layer["vocab_size"]) == (H, INTER, NH, NKV, HD, V)
    assert layer["rope_theta"] == 10000.0 and layer["rope_scaling"] is None
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert layer["max_position_embeddings"] >= target.config.max_position_embeddings
    assert layer["tie_word_embeddings"] is False and layer["attention_bias"] is False and layer["mlp_bias"] is False
    assert config["draft_vocab_size"] == (VD if reduced else V)  # always written
    assert config["target_hidden_size"] == H and config["torch_dtype"] == "float32"
    assert config["norm_before_residual"] is False
    if fmt == "vllm":
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    else:
        assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
        spec = config["speculators_config"]
        assert spec["verifier"]["name_or_path"] == NAME and spec["proposal_methods"][0]["speculative_tokens"] == 3


def test_eagle3_layer_id_fields(tmp_path, target, eagle3_reduced, eagle3_custom):
    default = _config(export_head(eagle3_reduced, tmp_path / "default", "sglang", target=target))
    assert "eagle_aux_hidden_state_layer_ids" not in default and "eagle_config" not in default
    custom = _config(export_head(eagle3_custom, tmp_path / "custom", "vllm", target=target))
    assert custom["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    assert custom["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 3, 5], "use_aux_hidden_state": True}
    spec = _config(export_head(eagle3_reduced, tmp_path / "spec", "speculators", target=target))
    assert spec["eagle_aux_hidden_state_layer_ids"] == default_aux_layer_ids(L)
    card = (tmp_path / "custom" / "README.md").read_text()
    assert "[1, 4, 6]" in card and "[0, 3, 5]" in card and "entering" in card


def test_speculators_verifier_for_a_head_of_a_local_target(tmp_path, target, eagle3_reduced):
    """A head trained on a local target names no Hub id: refused with the way out (--verifier), which is
    written as given; verifier= belongs to the speculators format only."""
    local = copy.deepcopy(eagle3_reduced)
    local.config.target_name_or_path = str(tmp_path / "my-target")
    (tmp_path / "my-target").mkdir()
    with pytest.raises(ValueError, match="pass verifier= \\(--verifier\\)"):
        export_head(local, tmp_path / "a", "speculators")
    with pytest.raises(ValueError, match="carries the target's embed_tokens.weight.*pass target= the target model"):
        export_head(local, tmp_path / "a", "speculators", verifier="/models/my-target")
    spec = _config(export_head(local, tmp_path / "b", "speculators", verifier="/models/my-target", target=target))
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "/models/my-target"
    with pytest.raises(ValueError, match="verifier= names the target in speculators configs only"):
        export_head(local, tmp_path / "c", "vllm", verifier="/models/my-target")
    with pytest.raises(ValueError, match="verifier= is empty"):
        export_head(local, tmp_path / "d", "speculators", verifier=" ")


@pytest.mark.parametrize("custom", [False, True])
def test_every_engine_captures_the_layers_the_head_was_trained_on(tmp_path, target, eagle3_reduced,
                                                                  eagle3_custom, custom):
    head = eagle3_custom if custom else eagle3_reduced
    out = export_head(head, tmp_path / "out", "vllm", target=target)
    config, card = _config(out), (out / "README.md").read_text()
    with torch.no_grad():
        hidden = target(torch.tensor([[1, 5, 9, 3]]), output_hidden_states=True).hidden_states
    want = [hidden[k] for k in head.feature_layer_ids]
    for got in (vllm_states(config, hidden), sglang_states(config, hidden), trtllm_states(card, hidden)):
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_eagle_vllm_layout(tmp_path, target):
    head = perturb(build_head("eagle", target))
    out = export_head(head, tmp_path / "out", "eagle-vllm", target=target)
    tensors = _tensors(out / "model.safetensors")
    expected = {"fc.weight": (H, 2 * H), **_midlayer_spec("layers.0.", H)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in tensors.items())
    config = _config(out)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert "layers.0.input_layernorm.weight" not in tensors and "norm.weight" not in tensors


def test_medusa_vllm_and_tgi_layouts(tmp_path, target):
    head = perturb(build_head("medusa", target, num_heads=3, num_layers=2))
    state = head.state_dict()
    vllm = export_head(head, tmp_path / "vllm", "medusa-vllm", target=target)
    tensors = _tensors(vllm / "model.safetensors")
    assert tensors.keys() == state.keys() and all(torch.equal(tensors[k], state[k]) for k in state)
    config = _config(vllm)
    assert (config["model_type"], config["architectures"], config["num_heads"], config["num_hidden_layers"],
            config["truncated_vocab_size"], config["medusa_fc_bias"]) == ("medusa", ["MedusaModel"], 3, 2, V, True)
    assert not [k for k in config if "num" in k and k not in ("num_heads", "num_hidden_layers")]

    tgi = export_head(head, tmp_path / "tgi", "medusa-tgi", target=target)
    assert sorted(p.name for p in tgi.iterdir()) == [EXPORT_MARKER, "README.md", "config.json",
                                                     "medusa_lm_head.safetensors"]
    tensors = _tensors(tgi / "medusa_lm_head.safetensors")
    expected = {f"{i}.{j}.linear.{p}": state[f"blocks.{i}.layers.{j}.{p}"]
                for i in range(3) for j in range(2) for p in ("weight", "bias")}
    expected.update({f"{i}.2.weight": state[f"lm_heads.{i}.weight"] for i in range(3)})
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
    config = _config(tgi)
    assert (config["medusa_num_heads"], config["medusa_num_layers"], config["base_model_name_or_path"]) == (3, 2, NAME)
    assert "architectures" not in config


def test_dtype_cast_keeps_vocab_maps_integer(tmp_path, target, eagle3_reduced):
    out = export_head(eagle3_reduced, tmp_path / "out", "vllm", target=target, dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL" and set(dtypes.values()) == {"BF16"}
    assert _config(out)["torch_dtype"] == "bfloat16"


def test_context_follows_the_target(tmp_path, eagle3_reduced):
    long = LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L, num_attention_heads=NH,
                       num_key_value_heads=NKV, vocab_size=V, max_position_embeddings=4096)
    out = export_head(eagle3_reduced, tmp_path / "out", "vllm", target=long)
    assert _config(out)["max_position_embeddings"] == 4096
    with pytest.raises(ValueError, match="max_position_embeddings=128 is below the target's context 4096"):
        export_head(eagle3_reduced, tmp_path / "short", "vllm", target=long, max_position_embeddings=128)
    assert not (tmp_path / "short").exists()


# ------------------------------------------------------------------------------------ refusals


def test_refusals_name_the_problem_and_write_nothing(tmp_path, target, eagle3_reduced, eagle3_custom):
    out = tmp_path / "out"
    other = make_tiny_target("llama", num_layers=L, vocab_size=100)
    cases = [
        (lambda: export_head(eagle3_reduced, out, "onnx"), "unknown format 'onnx'"),
        (lambda: export_head(eagle3_reduced, out, "medusa-tgi"), "exports medusa heads, got a eagle3 head"),
        (lambda: export_head(build_head("eagle3", target, aux_layer_ids=[2, 5]), out, "vllm"),
         r"aux_layer_ids \[2, 5\]: EAGLE-3 fuses exactly 3"),
        (lambda: export_head(build_head("eagle3", target, hidden_size=48, num_attention_heads=4, head_dim=12), out,
                             "vllm"), "hidden_size=48 differs from target_hidden_size=32"),
        (lambda: export_head(build_head("eagle", target, fc_bias=True), out, "eagle-vllm"), "fc_bias"),
        (lambda: export_head(build_head("eagle3", target, aux_layer_ids=[0, 4, 6]), out, "vllm"), "include 0"),
        (lambda: export_head(eagle3_reduced, out, "vllm", target=other),
         "vocab_size=96 .head. vs vocab_size=100"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        assert not out.exists(), message
    assert not list(tmp_path.iterdir())  # no staging directory left behind


def test_refuses_unsupported_rope_and_bad_draft_vocab(tmp_path, target):
    head = build_head("eagle3", target, draft_vocab_size=VD)
    head.set_draft_vocab(DRAFT_IDS)
    head.config.rope_config = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        export_head(head, tmp_path / "out", "vllm")
    head.config.rope_config = {"rope_type": "default", "rope_theta": 10000.0}
    with torch.no_grad():
        head.d2t[3] = -5  # target ids no longer increase
    with pytest.raises(ValueError, match="d2t: target ids .* must increase strictly"):
        export_head(head, tmp_path / "out", "vllm")
    head.set_draft_vocab(DRAFT_IDS)
    with torch.no_grad():
        head.t2d[1] = True  # one mark too many
    with pytest.raises(ValueError, match="t2d marks 41 tokens"):
        export_head(head, tmp_path / "out", "vllm")


def test_nameless_target_and_full_directory(tmp_path, eagle3_reduced):
    head = build_head("medusa", LlamaConfig(hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                                            num_attention_heads=NH, vocab_size=V))
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        export_head(head, tmp_path / "tgi", "medusa-tgi")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_head(eagle3_reduced, tmp_path / "full", "vllm")
    with pytest.raises(ValueError, match=r"refusing to replace .*full: it is not an export written by draftsmith.*keep.txt"):
        export_head(eagle3_reduced, tmp_path / "full", "vllm", overwrite=True)  # someone's folder: never deleted
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    export_head(eagle3_reduced, tmp_path / "empty", "vllm")  # an empty folder is fine
    assert (tmp_path / "empty" / EXPORT_MARKER).is_file()


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_overwrite_never_replaces_a_file_or_the_target(tmp_path, target, eagle3_reduced):
    """``export --target T --out T --overwrite`` is refused and T is intact; so is a file at --out."""
    from draftsmith.scripts import export

    head_dir, target_dir = tmp_path / "head", tmp_path / "target"
    eagle3_reduced.save_pretrained(head_dir)
    target.save_pretrained(target_dir)
    (target_dir / "README.md").write_text("the user's own card")
    before = _snapshot(tmp_path)
    argv = ["--head", str(head_dir), "--to", "vllm", "--target", str(target_dir), "--out", str(target_dir), "--overwrite"]
    assert export.cli(argv) == 2
    assert _snapshot(tmp_path) == before
    with pytest.raises(ValueError, match="refusing to replace .*not an export written by draftsmith.*config.json"):
        export_head(eagle3_reduced, target_dir, "vllm", overwrite=True)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is a file, not a directory"):
        export_head(eagle3_reduced, tmp_path / "notes.txt", "vllm", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def _rewrite(directory: Path, weights: str, edit_tensors=None, edit_config=None) -> None:
    if edit_tensors:
        tensors = _tensors(directory / weights)
        edit_tensors(tensors)
        save_file(tensors, str(directory / weights), metadata={"format": "pt"})
    if edit_config:
        config = _config(directory)
        edit_config(config)
        (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fmt,weights,tamper,message", [
    ("vllm", "model.safetensors", lambda t: t.pop("midlayer.hidden_norm.weight"),
     r"missing tensors \['midlayer.hidden_norm.weight'\]"),
    ("vllm", "model.safetensors", lambda t: t.update({"model.norm.weight": t["norm.weight"].clone()}),
     r"unexpected tensors \['model.norm.weight'\]"),
    ("vllm", "model.safetensors", lambda t: t.update({"fc.weight": t["fc.weight"][:, :64].clone()}),
     r"fc.weight: shape \(32, 64\), the config implies \(32, 96\)"),
    ("vllm", "model.safetensors", lambda t: t.pop("d2t"), "needs d2t and t2d"),
    ("medusa-tgi", "medusa_lm_head.safetensors", lambda t: t.pop("1.1.weight"), r"missing tensors \['1.1.weight'\]"),
])
def test_validate_export_catches_tampered_tensors(tmp_path, target, eagle3_reduced, fmt, weights, tamper, message):
    head = eagle3_reduced if fmt == "vllm" else build_head("medusa", target, num_heads=2)
    out = export_head(head, tmp_path / "out", fmt, target=target)
    _rewrite(out, weights, edit_tensors=tamper)
    with pytest.raises(ValueError, match=message):
        validate_export(out, fmt)


@pytest.mark.parametrize("fmt,tamper,message", [
    ("medusa-vllm", lambda c: c.update(target_num_layers=8), r"keys \['target_num_layers'\] would be renamed"),
    ("medusa-vllm", lambda c: c.pop("medusa_fc_bias"), "medusa_fc_bias"),
    ("medusa-tgi", lambda c: c.update(architectures=["MedusaModel"]), "TGI then treats"),
    ("vllm", lambda c: c.pop("eagle_config"), "write both eagle_aux_hidden_state_layer_ids"),
    ("vllm", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 4, 6]), "name different layers"),
    ("vllm", lambda c: c.update(rope_theta=500000.0), "rope_theta=500000.0 disagrees"),
    ("speculators", lambda c: c.update(norm_before_residual=None), "norm_before_residual must be written as false"),
])
def test_validate_export_catches_tampered_configs(tmp_path, target, eagle3_custom, fmt, tamper, message):
    head = eagle3_custom if fmt in ("vllm", "speculators") else build_head("medusa", target, num_heads=2)
    out = export_head(head, tmp_path / "out", fmt, target=target)
    _rewrite(out, "", edit_config=tamper)
    with pytest.raises(ValueError, match=message):
        validate_export(out, fmt)


# --------------------------------------------------------------------------------------- import


def _draft_logits(head: Eagle3Head) -> torch.Tensor:
    torch.manual_seed(3)
    aux, embeds = torch.randn(1, 6, 3 * H), torch.randn(1, 6, H)
    with torch.no_grad():
        hidden = head(head.project(aux), embeds, torch.arange(6)[None]).hidden_states
        return head.compute_logits(hidden)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_import_round_trip_is_exact(tmp_path, target, eagle3_reduced, eagle3_custom, fmt):
    for name, head in (("reduced", eagle3_reduced), ("custom", eagle3_custom)):
        out = export_head(head, tmp_path / name, fmt, target=target)
        back = import_eagle3(out)
        a, b = head.state_dict(), back.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert back.config.aux_layer_ids == head.config.aux_layer_ids
        assert back.config.rope_config == head.config.rope_config
        assert back.config.target_name_or_path == NAME and back.config.target_num_layers == L
        back.check_target(target)
        assert torch.equal(_draft_logits(back), _draft_logits(head))
        assert torch.equal(back.draft_vocab_ids(), head.draft_vocab_ids())


def test_autohead_loads_an_engine_export(tmp_path, target, eagle3_custom):
    out = export_head(eagle3_custom, tmp_path / "out", "sglang", target=target)
    head = AutoHead.from_pretrained(out)
    assert isinstance(head, Eagle3Head) and head.config.aux_layer_ids == [1, 4, 6]


def _public_checkpoint(tmp_path: Path, target, head, *, embed=None, bin_file=False, rename=None, config_edit=None):
    """Our export reshaped like a public checkpoint: no provenance, no layer ids, other names/files."""
    out = export_head(head, tmp_path / "public", "vllm", target=target)
    config = _config(out)
    for key in ("draftsmith", "eagle_aux_hidden_state_layer_ids", "eagle_config", "rope_parameters", "dtype"):
        config.pop(key, None)
    if config_edit:
        config_edit(config)
    (out / "config.json").write_text(json.dumps(config))
    tensors = _tensors(out / "model.safetensors")
    tensors = {(rename(k) if rename else k): v for k, v in tensors.items()}
    if embed is not None:
        tensors["embed_tokens.weight"] = embed
    (out / "model.safetensors").unlink()
    if bin_file:
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        save_file(tensors, str(out / "model.safetensors"))
    return out


def test_import_public_checkpoint_needs_the_target_for_default_layers(tmp_path, target, eagle3_reduced):
    embed = target.get_input_embeddings().weight.detach().clone()
    out = _public_checkpoint(tmp_path, target, eagle3_reduced, embed=embed, bin_file=True)
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        import_eagle3(out, target=target)
    with pytest.raises(ValueError, match="names no aux layers .* pass target="):
        import_eagle3(out, allow_embed_tokens=True)
    head = import_eagle3(out, target=target, allow_embed_tokens=True)
    assert head.config.aux_layer_ids == default_aux_layer_ids(L)
    assert (head.config.target_name_or_path, head.config.target_num_layers) == (NAME, L)
    head.check_target(target)
    assert torch.equal(_draft_logits(head), _draft_logits(eagle3_reduced))
    assert torch.equal(head.draft_vocab_ids(), DRAFT_IDS)
    with pytest.raises(ValueError, match="differs from the target's input embedding"):
        other = _public_checkpoint(tmp_path / "x", target, eagle3_reduced, embed=torch.randn(V, H))
        import_eagle3(other, target=target, allow_embed_tokens=True)


def test_import_reads_both_layer_conventions(tmp_path, target, eagle3_custom):
    sglang_only = _public_checkpoint(tmp_path / "s", target, eagle3_custom, config_edit=lambda c: c.update(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 5], "use_aux_hidden_state": True}))
    assert import_eagle3(sglang_only).config.aux_layer_ids == [1, 4, 6]
    vllm_style = _public_checkpoint(  # vLLM/speculators dumps: "model." prefix and "layers.0"
        tmp_path / "v", target, eagle3_custom, rename=lambda k: "model." + k.replace("midlayer.", "layers.0."),
        config_edit=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 4, 6]))
    head = import_eagle3(vllm_style, target=target)
    assert head.config.aux_layer_ids == [1, 4, 6]
    assert torch.equal(_draft_logits(head), _draft_logits(eagle3_custom))
    assert aux_layer_ids_from_config({}, num_layers=32) == [2, 16, 29]
    with pytest.raises(ValueError, match="name different layers"):
        aux_layer_ids_from_config({"eagle_aux_hidden_state_layer_ids": [2, 16, 29],
                                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}})


@pytest.mark.parametrize("rename,edit,message", [
    (None, lambda t: t.pop("midlayer.mlp.up_proj.weight"), r"missing tensors \['midlayer.mlp.up_proj.weight'\]"),
    (None, lambda t: t.update({"extra.weight": torch.zeros(2)}), r"unexpected tensors \['extra.weight'\]"),
    (None, lambda t: t.update({"norm.weight": torch.ones(H + 1)}), r"norm.weight: shape \(33,\)"),
    (None, lambda t: t.pop("d2t"), "has no d2t"),
])
def test_import_rejects_bad_tensors(tmp_path, target, eagle3_reduced, rename, edit, message):
    out = export_head(eagle3_reduced, tmp_path / "out", "vllm", target=target)
    _rewrite(out, "model.safetensors", edit_tensors=edit)
    with pytest.raises(ValueError, match=message):
        import_eagle3(out)


def test_import_rejects_a_mismatched_target_and_variants(tmp_path, target, eagle3_reduced):
    out = export_head(eagle3_reduced, tmp_path / "out", "vllm", target=target)
    with pytest.raises(ValueError, match=r"vocab_size=96 \(checkpoint\) vs vocab_size=100 \(target\)"):
        import_eagle3(out, target=make_tiny_target("llama", num_layers=L, vocab_size=100).config)
    _rewrite(out, "", edit_config=lambda c: c.update(norm_before_residual=True))
    with pytest.raises(ValueError, match="norm_before_residual=true"):
        import_eagle3(out)
    _rewrite(out, "", edit_config=lambda c: c.update(norm_before_residual=False, target_hidden_size=64))
    with pytest.raises(ValueError, match="hidden_size=32 differs from target_hidden_size=64"):
        import_eagle3(out)
    with pytest.raises(TypeError, match="device_map"):
        import_eagle3(out, device_map="auto")


# ---------------------------------------------------------------------- decoding and the CLI


def test_round_trip_decodes_identically(tmp_path, target, eagle3_reduced):
    from draftsmith.infer import DynamicTree, SpeculativeGenerator

    back = import_eagle3(export_head(eagle3_reduced, tmp_path / "out", "speculators", target=target))
    prompt = torch.tensor([[1, 7, 22, 5, 9]])
    runs = []
    for head in (eagle3_reduced, back):
        gen = SpeculativeGenerator(target, head, tree=DynamicTree(depth=3, top_k=3, total_tokens=8))
        drafts, propose = [], gen.drafter.propose_rows  # the generator drafts every row at once

        def recording(*args, _propose=propose, _drafts=drafts, **kwargs):  # every tree the head proposes
            out = _propose(*args, **kwargs)
            _drafts.extend(draft.tokens.clone() for draft in out)
            return out

        gen.drafter.propose_rows = recording
        runs.append((gen.generate(prompt, max_new_tokens=8), drafts))
    with torch.no_grad():
        greedy = hf_greedy(target, prompt, 8)
    (out_a, drafts_a), (out_b, drafts_b) = runs
    assert torch.equal(out_a, out_b) and torch.equal(out_a.flatten()[-8:], greedy.flatten()[-8:])
    assert len(drafts_a) == len(drafts_b) > 0 and len(drafts_a[0]) == 8  # a full tree
    assert all(torch.equal(a, b) for a, b in zip(drafts_a, drafts_b, strict=True))


def _script(name: str):
    path = REPO / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_cli(tmp_path, target, eagle3_reduced, capsys):
    eagle3_reduced.save_pretrained(tmp_path / "head")
    export = _script("export")
    out = export.main(["--head", str(tmp_path / "head"), "--to", "vllm", "--out", str(tmp_path / "out"),
                       "--dtype", "bfloat16"])
    validate_export(out, "vllm")
    assert _config(out)["torch_dtype"] == "bfloat16" and "exported as 'vllm'" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        export.main(["--head", str(tmp_path / "head"), "--to", "tensorrt", "--out", str(tmp_path / "x")])
    assert set(FORMATS) == {"vllm", "sglang", "speculators", "eagle-vllm", "medusa-vllm", "medusa-tgi", "dflash", "dspark", "mtp"}


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_export_never_writes_over_or_into_the_head_it_reads(tmp_path, eagle3_reduced, where):
    run = tmp_path / "run"
    eagle3_reduced.save_pretrained(run)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "best").mkdir()
    head = AutoHead.from_pretrained(run)
    out = {"same": run, "inside": run / "export", "parent": tmp_path}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="refusing to write"):
        export_head(head, out, "vllm", overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_overwrite_replaces_an_export_but_not_a_training_run(tmp_path, eagle3_reduced):
    export_head(eagle3_reduced, tmp_path / "export", "vllm")
    export_head(eagle3_reduced, tmp_path / "export", "vllm", overwrite=True)  # an earlier export: replaced
    eagle3_reduced.save_pretrained(tmp_path / "other-run")
    with pytest.raises(ValueError, match="refusing to write.*draftsmith head"):
        export_head(eagle3_reduced, tmp_path / "other-run", "vllm", overwrite=True)
    (tmp_path / "runs" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="refusing to write.*checkpoints"):
        export_head(eagle3_reduced, tmp_path / "runs", "vllm", overwrite=True)


def test_formats_are_one_module_per_engine_family():
    """Layout: writers and validators per engine family beside the shared modules (validation, what differs from
    the head's own export, the consumer-code parity); a variant's own layout in variants/."""
    root = REPO / "heads" / "formats"
    assert not (root.parent / "formats.py").exists()
    assert {p.stem for p in root.glob("*.py")} == {"__init__", "validation", "eagle3", "speculators", "eagle",
                                                   "medusa", "public", "dflash", "parity", "consumer_speculators",
                                                   "differences", "mtp"}
    assert {p.stem for p in (root / "variants").glob("*.py")} == {"__init__", "dspark", "peagle"}
    assert max(len(p.read_text().splitlines()) for p in root.rglob("*.py")) < 300


@pytest.mark.parametrize("verifier, warning", [
    ("demo:tiny", "the verifier is demo:tiny, a draftsmith name that `vllm serve"),
    ("/models/my-target", "the verifier is the local path /models/my-target: `vllm serve"),
    ("org/target-model", None),  # a Hub id: vllm serve DIR loads it, no word
])
def test_an_export_whose_verifier_vllm_cannot_load_says_so(tmp_path, target, eagle3_reduced, capsys, verifier,
                                                           warning):
    from draftsmith.scripts.export import main

    eagle3_reduced.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")  # an EAGLE-3 speculators export carries the target's embedding
    main(["--head", str(tmp_path / "head"), "--to", "speculators", "--out", str(tmp_path / "out"),
          "--target", str(tmp_path / "target"), "--verifier", verifier])
    err = capsys.readouterr().err
    if warning is None:
        assert "warning" not in err
    else:
        lines = [line for line in err.splitlines() if "warning" in line]  # (save_pretrained's bars aside)
        assert len(lines) == 1 and lines[0].startswith(f"warning: {tmp_path / 'out'}: {warning}")
