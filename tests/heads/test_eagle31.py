"""EAGLE-3.1's two flags on the EAGLE-3 head (issue 16): ``fc_norm`` (an RMSNorm per aux layer before
fc, tensors ``fc_norm.{i}.weight``) and ``norm_output`` (the next step reads ``norm(out)``); checked
against hand computations, trained, exported for vLLM/speculators and imported back exactly (refused for
SGLang, whose reader ignores them), and lossless in generation."""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from support.formats import perturb
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from safetensors.torch import load_file, save_file

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head, import_eagle3, validate_export
from draftsmith.heads.layers import RMSNorm
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator
from draftsmith.train.config import ConfigError
from draftsmith.train.run import setup


@pytest.fixture(scope="module")
def target():
    model = make_tiny_target("llama", num_layers=8)
    model.config._name_or_path = "org/tiny-llama"
    return model


def _heads(target, **flags):
    """An EAGLE-3 head with ``flags`` and a plain one with the same shared weights."""
    torch.manual_seed(0)
    flagged = perturb(build_head("eagle3", target, **flags))
    plain = build_head("eagle3", target)
    plain.load_state_dict({k: v for k, v in flagged.state_dict().items() if not k.startswith("fc_norm.")})
    return flagged, plain.eval()


def test_fc_norm_normalises_each_aux_layer_before_fc(target):
    head, plain = _heads(target, fc_norm=True)
    assert sorted(k for k in head.state_dict() if k.startswith("fc_norm.")) == \
        ["fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"]
    h = target.config.hidden_size
    aux = torch.randn(2, 5, 3 * h) * 7
    expected = []
    for i in range(3):  # by hand: RMS-normalise chunk i, scale by its own weight
        chunk = aux[..., i * h:(i + 1) * h]
        norm = RMSNorm(h, head.config.rms_norm_eps)
        norm.weight.data = head.fc_norm[i].weight.data
        expected.append(norm(chunk))
    with torch.no_grad():
        torch.testing.assert_close(head.project(aux), plain.fc(torch.cat(expected, dim=-1)))
        assert not torch.allclose(head.project(aux), plain.project(aux))  # the flag changes the features


def test_norm_output_feeds_the_post_norm_state_forward(target):
    head, plain = _heads(target, norm_output=True)
    assert head.state_dict().keys() == plain.state_dict().keys()  # no new tensors
    h = target.config.hidden_size
    hidden, embeds, pos = torch.randn(1, 4, h), torch.randn(1, 4, h), torch.arange(4)[None]
    with torch.no_grad():
        out, raw = head(hidden, embeds, pos).hidden_states, plain(hidden, embeds, pos).hidden_states
        torch.testing.assert_close(out, plain.norm(raw))  # what the next step reads
        torch.testing.assert_close(head.compute_logits(out), plain.compute_logits(raw))  # same first logits
        nxt, nxt_plain = head(out, embeds, pos + 1).hidden_states, plain(raw, embeds, pos + 1).hidden_states
        assert not torch.allclose(head.compute_logits(nxt), plain.compute_logits(nxt_plain))


def test_flags_survive_save_load_and_a_missing_norm_is_refused(target, tmp_path):
    head, _ = _heads(target, fc_norm=True, norm_output=True)
    head.save_pretrained(tmp_path / "h")
    back = AutoHead.from_pretrained(tmp_path / "h")
    assert back.config.fc_norm and back.config.norm_output
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    plain, _ = _heads(target)
    plain.save_pretrained(tmp_path / "p")
    (tmp_path / "p" / "config.json").write_text(json.dumps({**config, "norm_output": False}))
    with pytest.raises(ValueError, match=r"fc_norm\.0\.weight"):  # declared by the config, absent from the file
        AutoHead.from_pretrained(tmp_path / "p")
    with pytest.raises(ValueError, match="fc_norm must be true or false"):
        build_head("eagle3", target, fc_norm="yes")


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_export_writes_the_flags_and_imports_back_exactly(target, tmp_path, fmt):
    head, _ = _heads(target, fc_norm=True, norm_output=True)
    out = export_head(head, tmp_path / fmt, fmt, target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    validate_export(out, fmt)  # raises on any problem
    back = import_eagle3(out)
    assert back.config.fc_norm and back.config.norm_output
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain_out = export_head(_heads(target)[0], tmp_path / f"{fmt}-plain", fmt, target=target)
    plain_config = json.loads((plain_out / "config.json").read_text())
    # fc_norm explicit; norm_output false explicit where every reader means post-norm (speculators), left out of
    # the flat config, where SpecForge would read an explicit false as logits without the final norm
    assert plain_config["fc_norm"] is False
    assert plain_config.get("norm_output", "absent") == (False if fmt == "speculators" else "absent")
    tensors = load_file(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "fc_norm.1.weight"}, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"fc_norm\.1\.weight"):
        validate_export(out, fmt)


@pytest.mark.parametrize("flags", [{"norm_output": True}, {"fc_norm": True}, {"fc_norm": True, "norm_output": True}])
def test_sglang_export_refuses_what_its_reader_ignores_and_the_card_says_so(target, tmp_path, flags):
    """SGLang's LlamaForCausalLMEagle3 as read (commit d737979) reads neither flag: an EAGLE-3.1 head exported for it
    would decode as a plain EAGLE-3 head, so ``--to sglang`` refuses it, naming the flags, and the ``--to vllm``
    card (the same files) serves it with vLLM and says why not with SGLang; a plain head still exports for both."""
    head, plain = _heads(target, **flags)
    named = " and ".join(f"{k}=true" for k in ("fc_norm", "norm_output") if k in flags)
    with pytest.raises(ValueError, match=f"refusing to export as 'sglang': the head sets {named} .*does not read"):
        export_head(head, tmp_path / "s", "sglang", target=target)
    assert not (tmp_path / "s").exists()
    card = (export_head(head, tmp_path / "v", "vllm", target=target) / "README.md").read_text()
    assert "vllm serve" in card and "sglang.launch_server" not in card and "does not read" in card
    plain_card = (export_head(plain, tmp_path / "p", "sglang", target=target) / "README.md").read_text()
    assert "sglang.launch_server" in plain_card


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_eagle31_generation_is_lossless(arch):
    model = make_tiny_target(arch, num_layers=8, dtype=torch.float32)
    torch.manual_seed(1)
    head = perturb(build_head("eagle3", model, fc_norm=True, norm_output=True))
    prompt = torch.randint(3, 96, (1, 9))
    expected = model.generate(prompt, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    for tree in (Chain(4), DynamicTree(depth=3, top_k=2, total_tokens=6)):
        out = SpeculativeGenerator(model, head, tree=tree).generate(prompt, max_new_tokens=24)
        assert torch.equal(out, expected), tree


def test_training_with_the_flags(tiny_files, tmp_path):
    out = tmp_path / "run"
    args = ["head.kind=eagle3", "head.fc_norm=true", "head.norm_output=true", "head.draft_vocab_size=96",
            "head.ttt_steps=2", "train.max_steps=3", "train.eval_every=3"]
    result = setup(tiny_config(tiny_files, out, *args))
    assert result.head.config.fc_norm and result.head.config.norm_output
    saved = AutoHead.from_pretrained(out)
    assert saved.config.fc_norm and saved.config.norm_output
    first = {k: v for k, v in saved.state_dict().items() if k.startswith("fc_norm.")}
    assert len(first) == 3 and any(not torch.all(v == 1) for v in first.values())  # the norms were trained
    with pytest.raises(ConfigError, match=r"head\.fc_norm applies only to head\.kind=eagle3"):
        tiny_config(tiny_files, tmp_path / "m", "head.kind=medusa", "head.fc_norm=true")
