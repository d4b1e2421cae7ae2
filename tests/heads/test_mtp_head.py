"""The MTP head (head.kind=mtp) as its family defines it: read with head.init=native from a tiny target whose
checkpoint carries its MTP layer as a release does, it computes what the engines' formulas compute (an
independent reference: tests/support/mtp_targets.py); refusals in one line; its tensors go back to the
checkpoint's names and form bit for bit; it saves and loads as a draftsmith head."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from support.mtp_targets import STYLES, make_mtp_target, reference_mtp
from support.targets import make_tiny_target

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.mtp_native import checkpoint_files, native_state_dict


@pytest.fixture(scope="module", params=STYLES)
def mtp_target(request, tmp_path_factory):
    return make_mtp_target(request.param, tmp_path_factory.mktemp(request.param) / "target")


def _inputs(seed: int = 0, t: int = 7, width: int = 32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, width, generator=g), torch.randn(1, t, width, generator=g), torch.arange(t)[None]


def test_native_head_computes_the_reference(mtp_target):
    head = build_head("mtp", mtp_target.model)
    styles = {"deepseek_v3": "deepseek", "qwen3_next": "qwen3_next", "mellum": "mellum"}
    assert head.config.init == "native" and head.config.style == styles[mtp_target.model.config.model_type]
    hidden, embeds, positions = _inputs()
    out = head(hidden, embeds, positions).hidden_states
    torch.testing.assert_close(out, reference_mtp(mtp_target, hidden, embeds, positions), rtol=1e-5, atol=1e-5)


def test_a_fresh_head_is_not_the_native_one(mtp_target):
    """The reference comparison above can fail: a fresh head (random) computes something else."""
    torch.manual_seed(0)
    head = build_head("mtp", mtp_target.model, init="fresh")
    hidden, embeds, positions = _inputs()
    assert (head(hidden, embeds, positions).hidden_states - reference_mtp(mtp_target, hidden, embeds, positions)
            ).abs().max() > 1e-2


def test_native_tensors_go_back_bit_for_bit(mtp_target):
    """The head's tensors under the family's names and form (per-expert MoE weights) equal the checkpoint's."""
    head = build_head("mtp", mtp_target.model)
    ours = native_state_dict(head)
    release = {}
    for path in checkpoint_files(mtp_target.folder):
        with safe_open(str(path), framework="pt") as f:
            release.update({k: f.get_tensor(k) for k in f.keys() if k in ours})
    assert sorted(release) == sorted(ours)
    assert all(torch.equal(ours[k], release[k]) for k in ours)


def test_saved_head_loads_back_identical(mtp_target, tmp_path):
    head = build_head("mtp", mtp_target.model)
    head.save_pretrained(tmp_path / "head")
    again = AutoHead.from_pretrained(tmp_path / "head")
    assert type(again) is type(head) and again.config.style == head.config.style
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    hidden, embeds, positions = _inputs(1)
    torch.testing.assert_close(again(hidden, embeds, positions).hidden_states, head(hidden, embeds, positions).hidden_states)


def test_native_is_refused_where_the_target_has_no_mtp_layer(tmp_path):
    llama = make_tiny_target("llama", num_layers=2)
    with pytest.raises(ValueError, match=r"^head.init=native: target .* declares no MTP layer .*head.init=fresh"):
        build_head("mtp", llama, init="native")
    assert build_head("mtp", llama).config.init is None  # the default on such a target: fresh


def test_native_is_refused_where_the_checkpoint_lost_its_mtp_tensors(mtp_target, tmp_path):
    """A target saved by transformers (which drops the MTP tensors) declares MTP layers it no longer holds."""
    mtp_target.model.save_pretrained(tmp_path / "resaved")
    from transformers import AutoModelForCausalLM

    resaved = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved")
    with pytest.raises(ValueError, match=r"holds no MTP tensors .*declares 1 MTP layer\(s\).*\(transformers drops them at load\)$"):
        build_head("mtp", resaved)


def test_bad_options_are_refused_in_one_line():
    llama = make_tiny_target("llama", num_layers=2)
    with pytest.raises(ValueError, match=r"^init must be one of \['native', 'fresh'\], got 'copy'$"):
        build_head("mtp", llama, init="copy")
    with pytest.raises(ValueError, match=r"^num_mtp_layers must be a whole number >= 1, got 0$"):
        build_head("mtp", llama, num_mtp_layers=0)


def test_mellum_head_is_transformers_own_mtp_layer(tmp_path):
    """On a Mellum target transformers reads the MTP layer itself (``MtpModel.from_pretrained``, what
    ``generate(use_mtp=True)`` drafts with): the native head holds its tensors bit for bit and computes its output."""
    from transformers.modeling_layers import MtpModel

    t = make_mtp_target("mellum", tmp_path / "target")
    head = build_head("mtp", t.model)
    theirs = MtpModel.from_pretrained(t.model).eval()
    ours, want = head.layers.state_dict(), theirs.layers.state_dict()
    assert sorted(ours) == sorted(want) and all(torch.equal(ours[k], want[k]) for k in ours)
    hidden, embeds, positions = _inputs(2)
    rope = theirs.rotary_emb(embeds, positions, layer_type=theirs.config.layer_types[0])
    with torch.no_grad():
        expected = theirs.layers[0](embeds, hidden, rope, None, positions, None)
    torch.testing.assert_close(head(hidden, embeds, positions).hidden_states, expected, rtol=1e-5, atol=1e-5)


def test_native_reads_a_demo_target_from_its_cache_folder(mtp_target, monkeypatch):
    """Training names a demo target ``demo:<size>`` (as its cards do), not its cache path: the native tensors come
    from the folder that name resolves to."""
    import draftsmith.heads.mtp_native as native

    monkeypatch.setattr(native, "demo_target_path", lambda name: str(mtp_target.folder) if name == "demo:x" else "")
    monkeypatch.setattr(mtp_target.model.config, "_name_or_path", "demo:x")
    head = build_head("mtp", mtp_target.model)
    hidden, embeds, positions = _inputs()
    torch.testing.assert_close(head(hidden, embeds, positions).hidden_states,
                               reference_mtp(mtp_target, hidden, embeds, positions), rtol=1e-5, atol=1e-5)
