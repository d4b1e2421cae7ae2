"""A PEFT adapter directory as the target: loaded on its base with peft and merged; speculative
decoding with it is token-identical to the merged model's own greedy decoding and samples its law.

The adapters are random LoRA adapters built in-process: peft starts lora_B at zero (the adapter
would change nothing), so B is randomised and every test also checks that the adapter moved the
model away from its base."""
from __future__ import annotations

import json

import pytest
import torch
from support.targets import make_tiny_target
from support.sampling import VOCAB, exact_law, joint_pvalue, sample_triples
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)
from support.peft_targets import save_adapter

from draftsmith.data.targets import load_target, load_target_config, load_target_tokenizer, resolve_target
from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.card import model_card
from draftsmith.infer import SpeculativeGenerator, StaticTree
from draftsmith.train.run import setup
from draftsmith.train.warm_start import warm_start

ADAPTED_ARCHES = ("llama", "qwen2", "mistral")


@pytest.mark.parametrize("arch", ADAPTED_ARCHES)
def test_adapter_target_decodes_as_the_merged_model(tmp_path, arch):
    base = make_tiny_target(arch)
    base.generation_config.eos_token_id = None
    base_out = base.generate(torch.tensor([[1, 7, 3, 9]]), max_new_tokens=24, do_sample=False)
    adapter_dir, reference = save_adapter(base, tmp_path)

    merged = load_target(resolve_target(str(adapter_dir)))
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # merging is exact up to rounding: same logits as base + adapter unmerged
        torch.testing.assert_close(merged(ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert merged.config._name_or_path == str(adapter_dir)
    assert merged.config.adapter_base_name_or_path == str(tmp_path / "base")

    torch.manual_seed(0)
    head = build_head("medusa", merged, num_heads=3)
    gen = SpeculativeGenerator.from_pretrained(str(adapter_dir), head, device="cpu", threads=1,
                                               tree=StaticTree(((0,), (1,), (0, 0), (0, 0, 0))))
    gen.target.generation_config.eos_token_id = None
    prompt = torch.tensor([[1, 7, 3, 9]])
    out = gen.generate(prompt, max_new_tokens=24)
    want = merged.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert torch.equal(out, want)
    assert not torch.equal(want, base_out), "the adapter did not change the base's greedy output"
    assert head.config.target_name_or_path == str(adapter_dir)
    assert head.config.target_base_name_or_path == str(tmp_path / "base")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ADAPTED_ARCHES)
def test_adapter_target_samples_the_merged_models_law(tmp_path, arch):
    base = make_tiny_target(arch, vocab_size=VOCAB, hidden_size=16, num_heads=2, num_kv_heads=1,
                            intermediate_size=32, initializer_range=0.5, seed=3)
    adapter_dir, reference = save_adapter(base, tmp_path, scale=1.0)
    torch.manual_seed(1)
    gen = SpeculativeGenerator.from_pretrained(str(adapter_dir), lambda t: build_head("medusa", t, num_heads=2),
                                               device="cpu", threads=1, tree=StaticTree(((0,), (1,), (0, 0))))
    gen.target.generation_config.eos_token_id = None
    sampling = {"temperature": 0.8}
    law = exact_law(reference, 0.8, 0, 1.0)  # the unmerged peft model's law: independent of the merge
    base_law = exact_law(base, 0.8, 0, 1.0)
    assert (law - base_law).abs().sum() > 0.2, "the adapter barely changed the law; the test could not fail"
    samples, _ = sample_triples(gen, 1500, **sampling)
    assert joint_pvalue(samples, law) > 1e-3
    assert joint_pvalue(samples, base_law) < 1e-6  # and the base's law is told apart


def test_pickled_adapter_is_refused(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x/y"}))
    (adapter / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"adapter_model.bin \(a pickle"):
        resolve_target(str(adapter))
    (adapter / "adapter_model.bin").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        resolve_target(str(adapter))


def test_adapter_without_base_name_is_refused(tmp_path):
    adapter_dir, _ = save_adapter(make_tiny_target("llama"), tmp_path)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no base_model_name_or_path"):
        load_target(str(adapter_dir))


def test_training_on_an_adapter_target_names_base_and_adapter(tiny_files, tmp_path):
    base = load_target(str(tiny_files["target"]))
    adapter_dir, _ = save_adapter(base, tmp_path / "peft", scale=0.05)
    load_target_tokenizer(str(tiny_files["target"])).save_pretrained(tmp_path / "peft/base")
    assert not (adapter_dir / "tokenizer_config.json").exists()
    assert len(load_target_tokenizer(str(adapter_dir))) == 300  # the adapter ships none: its base's
    config = load_target_config(str(adapter_dir))
    assert config._name_or_path == str(adapter_dir) and config.adapter_base_name_or_path == str(tmp_path / "peft/base")

    cfg = tiny_config(tiny_files, tmp_path / "run", f"target={adapter_dir}", "head.kind=medusa", "head.num_heads=2",
                      "train.max_steps=6", "train.eval_every=6", "train.log_every=3", "train.lr=1e-2")
    result = setup(cfg)
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    head = AutoHead.from_pretrained(result.output_dir)
    assert head.config.target_name_or_path == str(adapter_dir)
    assert head.config.target_base_name_or_path == str(tmp_path / "peft/base")
    card = model_card(head)
    assert "| base model |" in card and "PEFT adapter" in card


def test_init_from_warm_starts_a_head_trained_on_the_base(tiny_files, tmp_path):
    medusa = ["head.kind=medusa", "head.num_heads=2", "train.lr=1e-2", "train.eval_every=0", "train.log_every=1"]
    trained = setup(tiny_config(tiny_files, tmp_path / "base-run", *medusa, "train.max_steps=12"))
    adapter_dir, _ = save_adapter(load_target(str(tiny_files["target"])), tmp_path / "peft", scale=0.05)
    load_target_tokenizer(str(tiny_files["target"])).save_pretrained(tmp_path / "peft/base")

    def first_loss(name: str, *extra: str) -> float:
        run = setup(tiny_config(tiny_files, tmp_path / name, *medusa, f"target={adapter_dir}", "train.max_steps=1",
                                *extra))
        return run.history[0]["loss"]

    cold, warm = first_loss("cold"), first_loss("warm", f"train.init_from={trained.output_dir}")
    assert warm < cold - 0.5, (warm, cold)  # the trained head already predicts most of what the adapted target does
    warmed = AutoHead.from_pretrained(tmp_path / "warm")
    assert warmed.config.target_name_or_path == str(adapter_dir)  # this run's target, not the base's

    fresh = build_head("medusa", load_target(str(adapter_dir)), num_heads=2)
    warm_start(fresh, str(trained.output_dir))
    assert all(torch.equal(v, trained.head.state_dict()[k].cpu()) for k, v in fresh.state_dict().items())
    with pytest.raises(ValueError, match="num_heads: 2 \\(init_from\\) vs 3 \\(this run\\)"):
        warm_start(build_head("medusa", load_target(str(adapter_dir)), num_heads=3), str(trained.output_dir))
    with pytest.raises(ValueError, match="a medusa head; this run trains head.kind=eagle"):
        warm_start(build_head("eagle", load_target(str(adapter_dir))), str(trained.output_dir))


def test_adapter_by_hub_id_takes_the_same_path(tmp_path, monkeypatch):
    """A Hub id (here from an offline Hub cache) is an adapter when its repo has adapter_config.json;
    its base is a Hub id too. A repo with only a pickled adapter is refused."""
    from support.hub import install_in_offline_cache

    adapter_dir, reference = save_adapter(make_tiny_target("qwen2"), tmp_path)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "user/tiny-base"
    files = {"adapter_config.json": json.dumps(config).encode(),
             "adapter_model.safetensors": (adapter_dir / "adapter_model.safetensors").read_bytes()}
    cache = tmp_path / "cache"
    install_in_offline_cache(monkeypatch, cache, "user/tiny-lora", files)
    install_in_offline_cache(monkeypatch, cache, "user/tiny-base",
                              {p.name: p.read_bytes() for p in (tmp_path / "base").iterdir()})
    install_in_offline_cache(monkeypatch, cache, "user/pickled-lora",
                              {"adapter_config.json": files["adapter_config.json"], "adapter_model.bin": b"x"})

    merged = load_target(resolve_target("user/tiny-lora"))
    ids = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert (merged.config._name_or_path, merged.config.adapter_base_name_or_path) == ("user/tiny-lora", "user/tiny-base")
    assert load_target_config("user/tiny-lora").adapter_base_name_or_path == "user/tiny-base"
    assert not hasattr(load_target("user/tiny-base").config, "adapter_base_name_or_path")  # a model, not an adapter
    with pytest.raises(ValueError, match=r"adapter_model.bin \(a pickle"):
        load_target("user/pickled-lora")


def test_export_checks_a_head_against_an_adapter_target(tmp_path):
    from draftsmith.scripts.export import main as export

    adapter_dir, _ = save_adapter(make_tiny_target("llama"), tmp_path)
    head = build_head("medusa", load_target(str(adapter_dir)), num_heads=2)
    head.save_pretrained(tmp_path / "head")
    out = export(["--head", str(tmp_path / "head"), "--to", "medusa-vllm", "--out", str(tmp_path / "export"),
                  "--target", str(adapter_dir)])
    assert "| base model |" in (out / "README.md").read_text()
    small = make_tiny_target("llama", hidden_size=16, num_heads=2, num_kv_heads=1)
    other_dir, _ = save_adapter(small, tmp_path / "other")
    with pytest.raises(ValueError, match="hidden_size=32 \\(head\\) vs hidden_size=16 \\(target\\)"):
        export(["--head", str(tmp_path / "head"), "--to", "medusa-vllm", "--out", str(tmp_path / "export2"),
                "--target", str(other_dir)])


def test_regeneration_engine_loads_an_adapter_target(tiny_files, tmp_path):
    from draftsmith.data.regenerate import HFEngine

    adapter_dir, reference = save_adapter(load_target(str(tiny_files["target"])), tmp_path, scale=0.2)
    load_target_tokenizer(str(tiny_files["target"])).save_pretrained(tmp_path / "base")
    engine = HFEngine(resolve_target(str(adapter_dir)), device="cpu")
    assert engine.model.config._name_or_path == str(adapter_dir)  # batches are left-padded by hand (HFEngine._generate)
    ids = torch.randint(5, 300, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(engine.model(ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
