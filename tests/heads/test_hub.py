"""Hub publishing: exactly which files (with which contents) are uploaded, the generated card, and
loading the uploaded repo back by id from the offline HF cache. Only HfApi's network calls are faked."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl
from safetensors.torch import load_file

from support.targets import make_tiny_target
from support.hub import install_in_offline_cache
from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.hub import push_head_to_hub
from support.house import REPO as ROOT

NAME, L = "org/tiny-llama", 8
REPO = "user/tiny-eagle3"
EVALS = [{"step": 10, "tau": 1.5, "acc": [0.4, 0.2], "cond_acc": [0.4, 0.5], "positions": 300},
         {"step": 20, "tau": 2.345, "acc": [0.61, 0.42], "cond_acc": [0.61, 0.7], "positions": 300},
         {"step": 30, "tau": 2.1, "acc": [0.55, 0.4], "cond_acc": [0.55, 0.7], "positions": 300}]
TRAIN_CONFIG = "target: org/tiny-llama\ndata:\n  train: stdlib:train\n  eval: stdlib:heldout\n  max_length: 256\n" \
               "train:\n  max_steps: 30\n  lr: 5.0e-05\n  micro_batch_size: 4\n  grad_accum_steps: 1\n" \
               "  mixed_precision: 'no'\n"


@pytest.fixture(scope="module")
def target():
    model = make_tiny_target("llama", num_layers=L)
    model.config._name_or_path = NAME
    return model


@pytest.fixture
def head(target):
    torch.manual_seed(0)
    head = build_head("eagle3", target, draft_vocab_size=40)
    head.set_draft_vocab(torch.arange(0, 80, 2))
    return head.eval()


@pytest.fixture
def head_dir(tmp_path, head):
    """A training output directory as train.run leaves it (head, metrics.jsonl, config.yaml, its own card)."""
    directory = tmp_path / "run"
    head.save_pretrained(directory)
    (directory / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in [{"step": 5, "loss": 3.2}, *EVALS]))
    (directory / "config.yaml").write_text(TRAIN_CONFIG)
    (directory / "README.md").write_text("the loop's card\n")
    (directory / "checkpoints").mkdir()  # training state never goes to the Hub
    (directory / "checkpoints" / "optimizer.bin").write_bytes(b"x")
    return directory


@pytest.fixture
def hub(monkeypatch):
    """Fake HfApi network calls; records the calls and the uploaded folder's files."""
    calls: dict = {"create_repo": [], "upload_folder": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"].append({"repo_id": repo_id, "token": self.token, **kwargs})
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = {p.relative_to(folder_path).as_posix(): p.read_bytes()
                 for p in Path(folder_path).rglob("*") if p.is_file()}
        calls["upload_folder"].append({"repo_id": repo_id, "files": files, **kwargs})
        return CommitInfo(commit_url=f"https://huggingface.co/{repo_id}/commit/abc123", commit_message="",
                          commit_description="", oid="abc123")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return calls


def _card(files: dict[str, bytes]) -> ModelCard:
    return ModelCard(files["README.md"].decode())


def test_push_uploads_the_head_its_training_record_and_a_card(tmp_path, head, head_dir, hub):
    url = push_head_to_hub(head_dir, REPO, private=True, token="hf_test")
    assert url == f"https://huggingface.co/{REPO}/commit/abc123"
    assert hub["create_repo"] == [{"repo_id": REPO, "token": "hf_test", "private": True, "exist_ok": True,
                                   "repo_type": "model"}]
    (upload,) = hub["upload_folder"]
    assert upload["repo_id"] == REPO and upload["repo_type"] == "model"
    files = upload["files"]
    assert sorted(files) == ["README.md", "config.json", "config.yaml", "metrics.jsonl", "model.safetensors"]
    assert json.loads(files["config.json"]) == json.loads((head_dir / "config.json").read_text())
    assert files["metrics.jsonl"] == (head_dir / "metrics.jsonl").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(files["model.safetensors"])
    weights, state = load_file(str(tmp_path / "w.safetensors")), head.state_dict()
    assert weights.keys() == state.keys() and all(torch.equal(weights[k], state[k]) for k in state)

    card = _card(files)
    assert card.data.base_model == NAME and card.data.library_name == "draftsmith"
    assert {"speculative-decoding", "eagle3", "draft-model"} <= set(card.data.tags)
    text = card.text
    assert "simulated τ 2.345** at step 20" in text and "0.610, 0.420" in text  # the best of 3 evaluations
    assert "stdlib:train" in text and "30 steps" in text
    assert "[2, 4, 5]" in text and "[1, 3, 4]" in text  # aux layers in both conventions
    assert f"SpeculativeGenerator.from_pretrained('{NAME}', '{REPO}')" in text
    assert f"--head {REPO} --to vllm" in text and '"method": "eagle3"' in text
    assert "sglang.launch_server" in text and "--speculative-algorithm EAGLE3" in text


@pytest.mark.parametrize("fmt", [None, "vllm"])
def test_pushed_repo_loads_back_by_id(tmp_path, monkeypatch, head, head_dir, hub, fmt):
    push_head_to_hub(head_dir, REPO, fmt=fmt)
    files = hub["upload_folder"][0]["files"]
    if fmt == "vllm":
        assert json.loads(files["config.json"])["architectures"] == ["LlamaForCausalLMEagle3"]
        assert "vllm" in _card(files).data.tags
        assert f'"model": "{REPO}"' in _card(files).text  # served straight from the repo
    install_in_offline_cache(monkeypatch, tmp_path / "cache", REPO, files)
    loaded = AutoHead.from_pretrained(REPO)
    a, b = head.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert loaded.config.aux_layer_ids == head.config.aux_layer_ids
    assert loaded.config.target_name_or_path == NAME


def test_push_a_head_object_in_an_engine_format(head, hub, target):
    medusa = build_head("medusa", target, num_heads=2)
    push_head_to_hub(medusa, "user/tiny-medusa", fmt="medusa-tgi")
    files = hub["upload_folder"][0]["files"]
    assert sorted(files) == ["README.md", "config.json", "medusa_lm_head.safetensors"]
    card = _card(files)
    assert {"medusa", "medusa-tgi"} <= set(card.data.tags) and "Training" not in card.text
    assert "text-generation-launcher --model-id user/tiny-medusa" in card.text


def test_broken_head_is_refused_before_any_network_call(head_dir, hub):
    weights = head_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="incomplete or corrupt"):
        push_head_to_hub(head_dir, REPO)
    with pytest.raises(ValueError, match="unknown format 'gguf'"):
        push_head_to_hub(head_dir, REPO, fmt="gguf")
    assert hub == {"create_repo": [], "upload_folder": []}


def test_push_cli(head_dir, hub, capsys):
    path = ROOT / "scripts" / "push_to_hub.py"
    spec = importlib.util.spec_from_file_location("scripts_push_to_hub", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--head", str(head_dir), "--repo-id", REPO, "--private"])
    assert hub["create_repo"][0]["private"] is True and REPO in capsys.readouterr().out
    assert script.cli(["--head", str(head_dir / "missing"), "--repo-id", REPO]) == 2
    assert capsys.readouterr().err.strip().endswith("missing is not a directory")


def test_head_push_to_hub_carries_the_card(monkeypatch, head, hub):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast instead of calling out
    push_head_to_hub(head, REPO)
    card = _card(hub["upload_folder"][0]["files"])
    assert card.data.library_name == "draftsmith" and card.data.base_model == NAME
