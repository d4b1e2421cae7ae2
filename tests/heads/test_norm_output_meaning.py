"""EAGLE-3.1's ``norm_output`` means two things (docs/export-keys.md, "norm_output"): vLLM, speculators, NeMo,
SGLang and draftsmith feed the post-norm state forward when it is true; SpecForge always feeds the pre-norm
state forward, defaults the flag to true and with false drops the final norm from the logits. Exports
record which meaning they use and write nothing SpecForge would misread as plain EAGLE-3; imports read a
SpecForge checkpoint with SpecForge's meaning and refuse what no draftsmith head computes."""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from support.formats import perturb

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head, import_eagle3, validate_export


@pytest.fixture(scope="module")
def target():
    model = make_tiny_target("llama", num_layers=8)
    model.config._name_or_path = "org/tiny-llama"
    return model


def _config(out):
    return json.loads((out / "config.json").read_text())


def _as_foreign(out, **flags):
    """Our flat export rewritten as another trainer saves it: no provenance, ``flags`` in the config."""
    config = {k: v for k, v in _config(out).items() if k != "draftsmith"}
    config.pop("norm_output", None)
    (out / "config.json").write_text(json.dumps({**config, **flags}))
    return out


def test_flat_exports_leave_a_false_norm_output_out_and_record_the_meaning(tmp_path, target):
    plain = export_head(perturb(build_head("eagle3", target)), tmp_path / "p", "vllm", target=target)
    assert "norm_output" not in _config(plain)  # SpecForge would read false as "no final norm on the logits"
    assert _config(plain)["draftsmith"]["norm_output_meaning"].startswith("post-norm")
    flagged = export_head(perturb(build_head("eagle3", target, norm_output=True)), tmp_path / "f", "vllm",
                          target=target)
    assert _config(flagged)["norm_output"] is True
    (plain / "config.json").write_text(json.dumps({**_config(plain), "norm_output": False}))  # the old export
    with pytest.raises(ValueError, match="norm_output=false written: SpecForge reads it as logits without"):
        validate_export(plain, "vllm")


def test_a_specforge_checkpoint_imports_with_specforges_meaning(tmp_path, target):
    """SpecForge's norm_output=true (its default) is plain EAGLE-3: pre-norm state forward, normed logits."""
    head = perturb(build_head("eagle3", target))
    out = _as_foreign(export_head(head, tmp_path / "s", "vllm", target=target), norm_output=True)
    with pytest.raises(ValueError, match="norm_output=true means two things.*norm_output_meaning='specforge'"):
        import_eagle3(out, target=target)
    back = AutoHead.from_pretrained(out, target=target, norm_output_meaning="specforge")
    assert back.config.norm_output is False
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))
    assert import_eagle3(out, target=target, norm_output_meaning="post-norm").config.norm_output is True
    _as_foreign(out, norm_output=False)
    with pytest.raises(ValueError, match="SpecForge's norm_output=false computes the logits without the final norm"):
        import_eagle3(out, target=target, norm_output_meaning="specforge")
    assert import_eagle3(_as_foreign(out), target=target).config.norm_output is False  # absent: plain for both
    with pytest.raises(ValueError, match="norm_output_meaning='vllm'; expected one of"):
        import_eagle3(out, target=target, norm_output_meaning="vllm")


def test_speculators_configs_mean_post_norm_without_being_told(tmp_path, target):
    head = perturb(build_head("eagle3", target, norm_output=True))
    out = export_head(head, tmp_path / "s", "speculators", target=target)
    config = {k: v for k, v in _config(out).items() if k != "draftsmith"}
    (out / "config.json").write_text(json.dumps(config))
    back = import_eagle3(out, target=target, allow_embed_tokens=True)
    assert back.config.norm_output is True
