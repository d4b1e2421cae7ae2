"""Medusa-2: LoRA on the target trained with the heads; the merged target saved beside them is the
head's target, decoding with it is lossless, and a resume continues the adapters exactly."""
from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
from support.targets import has_cuda
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.data.targets import load_target
from draftsmith.heads import AutoHead
from draftsmith.infer import SpeculativeGenerator, StaticTree
from draftsmith.train.backbone import LORA_ADAPTER, MERGED_TARGET, add_lora, lora_parameters, original
from draftsmith.train.checkpoint import CHECKPOINTS
from draftsmith.train.config import ConfigError
from draftsmith.train.run import setup
from draftsmith.train.resume import latest_checkpoint, mark_run

MEDUSA2 = ["head.kind=medusa", "head.num_heads=2", "train.backbone_lora_rank=4", "train.lr=1e-2",
           "train.backbone_lr=1e-3"]


def test_medusa2_saves_a_merged_target_that_decodes_losslessly(tiny_files, tmp_path):
    result = setup(tiny_config(tiny_files, tmp_path / "run", *MEDUSA2, "train.max_steps=6", "train.eval_every=6"))
    out = result.output_dir
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert losses and all(torch.isfinite(torch.tensor(losses)))

    head = AutoHead.from_pretrained(out)
    merged_dir = (out / MERGED_TARGET).resolve()
    assert head.config.target_name_or_path == str(merged_dir)
    assert head.config.target_base_name_or_path == str(tiny_files["target"])
    original_model = load_target(str(tiny_files["target"]))
    merged = load_target(str(merged_dir)).eval()
    moved = [name for name, p in merged.named_parameters()
             if not torch.equal(p, original_model.get_parameter(name))]
    assert moved, "training left the target unchanged: the adapters were not trained"
    assert not any("lm_head" in name or "embed" in name for name in moved)  # LoRA on the decoder's linears only

    # the saved adapter is a target too (base: the original), and it is the merged model
    ids = torch.randint(5, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_target(str(out / LORA_ADAPTER))(ids).logits, merged(ids).logits,
                                   rtol=1e-4, atol=1e-4)

    gen = SpeculativeGenerator.from_pretrained(head.config.target_name_or_path, str(out), device="cpu", threads=1,
                                               tree=StaticTree(((0,), (1,), (0, 0))))
    prompt = ids[:, :8]
    want = merged.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    gen.target.generation_config.eos_token_id = None
    assert torch.equal(gen.generate(prompt, max_new_tokens=24), want)

    # replaced by a Medusa-1 run: no merged target of the earlier run is left beside its head
    setup(tiny_config(tiny_files, tmp_path / "run", "head.kind=medusa", "head.num_heads=2", "train.max_steps=2",
                      "train.eval_every=0", "overwrite_output_dir=true"))
    assert not (out / MERGED_TARGET).exists() and not (out / LORA_ADAPTER).exists()
    assert AutoHead.from_pretrained(out).config.target_name_or_path == str(tiny_files["target"])


def test_medusa2_resume_continues_the_adapters_exactly(tiny_files, tmp_path):
    args = [*MEDUSA2, "train.grad_accum_steps=2", "train.max_steps=6", "train.save_every=3", "train.eval_every=3"]
    out = tmp_path / "run"
    setup(tiny_config(tiny_files, out, *args))
    reference = load_target(str(out / MERGED_TARGET)).state_dict()
    head_reference = AutoHead.from_pretrained(out).state_dict()

    shutil.rmtree(out / CHECKPOINTS / "step-0000006")  # as if the run died after step 5
    mark_run(out)
    assert latest_checkpoint(out).name == "step-0000003"
    assert (latest_checkpoint(out) / "backbone.safetensors").is_file()
    with pytest.raises(ConfigError, match="train.backbone_lr=0.001 in the checkpoint, 0.002 now"):
        setup(tiny_config(tiny_files, out, *args, "train.backbone_lr=2e-3", "resume_from=latest"))
    setup(tiny_config(tiny_files, out, *args, "resume_from=latest"))
    resumed = load_target(str(out / MERGED_TARGET)).state_dict()
    # on CUDA the backward through the target's attention may sum in another order from run to run
    same = torch.equal if not has_cuda() else partial(torch.allclose, rtol=1e-4, atol=1e-6)
    assert all(same(reference[k], resumed[k]) for k in reference), "resumed adapters differ"
    head = AutoHead.from_pretrained(out).state_dict()
    assert all(same(head_reference[k], head[k]) for k in head_reference)


def test_the_original_is_the_target_with_its_adapters_off(tiny_files):
    target = load_target(str(tiny_files["target"])).eval()
    ids = torch.randint(5, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = target(ids).logits
    backbone = add_lora(target, 4)
    with torch.no_grad():
        for p in lora_parameters(backbone).values():
            p.normal_(0, 0.5)  # B starts at zero; a random B makes the adapted model differ
        adapted = target(ids).logits
        with original(target):
            off = target(ids).logits
    assert not torch.allclose(adapted, before, atol=1e-3)
    torch.testing.assert_close(off, before)
    assert all(p.requires_grad for p in lora_parameters(backbone).values())  # switched back on, trainable


@pytest.mark.parametrize("override, message", [
    (["head.kind=eagle", "train.backbone_lora_rank=4"], "applies only to head.kind=medusa"),
    (["head.kind=medusa", "train.backbone_lr=1e-4"], "needs train.backbone_lora_rank"),
    (["head.kind=medusa", "train.backbone_lora_rank=-1"], "must be >= 0"),
    (["head.kind=medusa", "train.backbone_lora_rank=4", "train.heads_coefficient=0"], "must be > 0"),
])
def test_medusa2_keys_are_checked(tiny_files, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tiny_files, tmp_path / "run", *override)
