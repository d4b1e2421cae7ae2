"""``--to mtp``: an MTP head's tensors under the names the target's own checkpoint uses (its index file), the
target tensors the family's MTP layers carry (DeepSeek-V3: embed_tokens and shared_head.head; Qwen3-Next: none),
read back as the same head bit for bit, and a warm start (``train.init_from``) from the export or from the
target's own folder starts from those tensors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from support.mtp_targets import STYLES, tuned_export

from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head
from draftsmith.train.warm_start import warm_start


@pytest.fixture(scope="module", params=STYLES)
def exported(request, tmp_path_factory):
    """(target, a tuned head (perturbed: not the checkpoint's), its export folder)."""
    return tuned_export(request.param, tmp_path_factory.mktemp(request.param))


def _equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_export_uses_the_checkpoints_own_names(exported):
    t, _, out = exported
    index = json.loads((t.folder / "model.safetensors.index.json").read_text())["weight_map"]
    release = {k for k, f in index.items() if f == "model-00002-of-00002.safetensors"}  # the MTP shard
    assert set(load_file(out / "model.safetensors")) == release


def test_carried_target_tensors_are_the_targets(exported):
    t, _, out = exported
    tensors = load_file(out / "model.safetensors")
    if t.model.config.model_type == "deepseek_v3":
        assert torch.equal(tensors["model.layers.2.embed_tokens.weight"], t.model.get_input_embeddings().weight)
        assert torch.equal(tensors["model.layers.2.shared_head.head.weight"], t.model.get_output_embeddings().weight)
    else:
        assert not [k for k in tensors if "embed_tokens" in k or "lm_head" in k]


def test_the_export_reads_back_as_the_same_head(exported):
    _, head, out = exported
    again = AutoHead.from_pretrained(out)
    assert again.head_kind == "mtp" and again.config.style == head.config.style
    assert _equal(again, head)


@pytest.mark.parametrize("source", ["export", "target folder"])
def test_init_from_starts_from_those_tensors(exported, source):
    t, head, out = exported
    torch.manual_seed(0)
    fresh = build_head("mtp", t.model, init="fresh")
    assert not _equal(fresh, head)
    warm_start(fresh, str(out if source == "export" else t.folder))
    assert _equal(fresh, head if source == "export" else build_head("mtp", t.model))


def test_a_deepseek_export_without_the_target_is_refused(exported, tmp_path):
    t, head, _ = exported
    if head.config.style != "deepseek":
        export_head(head, tmp_path / "out", "mtp")  # Qwen3-Next carries nothing of the target's
        return
    with pytest.raises(ValueError, match=r"^the deepseek layout's MTP layers carry the target's embedding "
                                         r"\(model\.layers\.2\.embed_tokens\.weight.*pass the target \(--target\)"):
        export_head(head, tmp_path / "out", "mtp")
