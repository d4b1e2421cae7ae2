"""scripts/cost.py on a hybrid target counts the recurrent and conv states a sequence keeps when decoding,
and the checkpoint of them speculative decoding keeps per step: a hand count on a tiny Qwen3.5 config,
checked against the bytes the generator's states really hold after a prefill."""
from __future__ import annotations


import pytest
import torch
from support.targets import make_tiny_target
from support.hybrids import HYBRIDS, make_tiny_hybrid

from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.state_memory import state_memory
from draftsmith.scripts.cost import main
from draftsmith.train.config import load_config
from draftsmith.train.cost import format_plan, make_plan, target_config
from support.house import REPO

CONFIG = REPO / "configs" / "demo-hybrid.yaml"


def _prefilled_bytes(model, batch: int) -> int:
    gen = SpeculativeGenerator(model, NgramDrafter())
    with torch.no_grad():
        gen.prefill(torch.randint(3, 90, (batch, 10)), 8)
    return sum(t.numel() * t.element_size() for t in gen._static_cache.states.current().states.values())


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plan-hybrid") / "target"
    make_tiny_hybrid("qwen3_5_text", num_layers=8).save_pretrained(directory)
    return directory


def test_plan_counts_a_hybrids_states_by_hand(hybrid_dir, capsys):
    # tests/support/hybrids.py's Gated DeltaNet: 2 key heads, 4 value heads, head dims 8 x 8, conv kernel 4;
    # 8 layers with full attention every 4th: 6 Gated DeltaNet layers.
    conv = (2 * 2 * 8 + 4 * 8) * 4  # (2·key_dim + value_dim) × kernel = 256 elements
    recurrent = 4 * 8 * 8  # value heads × key dim × value dim = 256 elements
    fp32 = 6 * (conv * 4 + recurrent * 4)  # 12,288 B
    bf16 = 6 * (conv * 2 + recurrent * 4)  # the recurrent matrix stays fp32: 9,216 B
    cfg = load_config(CONFIG, [f"target={hybrid_dir}", "head.draft_vocab_size=64", "train.mixed_precision=no"])
    plan = make_plan(cfg, target_config(cfg.target), gpus=1)
    assert (plan.states.per_sequence, plan.states.checkpoint) == (fp32, fp32)
    assert plan.states.per_sequence == _prefilled_bytes(make_tiny_hybrid("qwen3_5_text", num_layers=8), 1)
    bf16_cfg = load_config(CONFIG, [f"target={hybrid_dir}", "head.draft_vocab_size=64", "train.mixed_precision=bf16"])
    assert make_plan(bf16_cfg, target_config(bf16_cfg.target), gpus=1).states.per_sequence == bf16
    assert main(["--config", str(CONFIG), f"target={hybrid_dir}", "head.draft_vocab_size=64", "train.mixed_precision=no",
                 "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert f"recurrent and conv states {fp32:,} B = 6 Gated DeltaNet layers" in out
    assert f"checkpoint speculative decoding keeps per step (one copy of every state) {fp32:,} B" in out
    assert f"= {2 * fp32:,} B per sequence" in out


@pytest.mark.parametrize("arch", sorted(HYBRIDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_formulas_match_the_states_every_hybrid_family_holds(arch, dtype):
    model = make_tiny_hybrid(arch).to(dtype)
    batch = 3  # per sequence × rows
    assert batch * state_memory(model.config, 4 if dtype == torch.float32 else 2).per_sequence == \
        _prefilled_bytes(model, batch)


def test_attention_only_targets_have_no_states_line(tmp_path):
    make_tiny_target("llama", num_layers=8).save_pretrained(tmp_path / "llama")
    cfg = load_config(CONFIG, [f"target={tmp_path / 'llama'}", "head.draft_vocab_size=64"])
    plan = make_plan(cfg, target_config(cfg.target), gpus=1)
    assert plan.states is None and "recurrent and conv states" not in format_plan(cfg, plan, 1, 1)


@pytest.mark.parametrize("make, extra", [("MambaConfig", {}), ("Mamba2Config", dict(num_heads=4, head_dim=16, n_groups=1))])
def test_a_target_without_attention_is_one_line(tmp_path, capsys, make, extra):
    """cost.py on a Mamba target ended in AttributeError (... max_position_embeddings)."""
    import transformers

    from draftsmith.data.entry_point import run

    config = getattr(transformers, make)(hidden_size=32, num_hidden_layers=2, vocab_size=96, **extra)
    config.save_pretrained(tmp_path / "mamba")
    assert run(main, ["--config", str(CONFIG), f"target={tmp_path / 'mamba'}", "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "has no attention layer" in err, err
