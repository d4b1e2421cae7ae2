"""Stateful models draftsmith cannot decode losslessly are refused in one line naming the architecture and its
layer kind, never a traceback: at ``SpeculativeGenerator``, at ``from_pretrained`` and ``scripts/benchmark.py``
before the weights load, and at training setup. transformers 5.24's stateful families outside
``target.recurrent.LAYER_KINDS`` (tests/support/hybrids.py holds the supported ones): MiniMax (lightning attention, its
own MiniMaxCache), RecurrentGemma (RG-LRU blocks keeping their state on the module), and the attention-free
Mamba, Mamba-2, Falcon-Mamba, RWKV and xLSTM; a stateful family the table does not know is refused alike.
RecurrentGemma's refusal is needed: let through, its speculative output differs from its own ``generate``."""
from __future__ import annotations

import random

import pytest
from support import train_fixtures
import torch
from support.targets import make_tiny_target
from support.hybrids import make_tiny_hybrid
from support.train_fixtures import tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.data.entry_point import run
from draftsmith.data.tokenizer import train_tokenizer
from draftsmith.infer import SpeculativeGenerator
from draftsmith.infer.drafters.free.ngram import NgramDrafter
from draftsmith.target.recurrent import LAYER_KINDS, REFUSED_KINDS, LinearAttentionLayer, check_supported, is_hybrid
from draftsmith.scripts.benchmark import main as benchmark_main
from draftsmith.train.run import setup

pytestmark = pytest.mark.skipif(LinearAttentionLayer is None, reason="hybrid targets need transformers >= 5.24")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
# model_type -> (class name, layer kind named in the refusal, config overrides)
REFUSED = {
    "minimax": ("MiniMaxForCausalLM", "lightning attention",
                dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                     head_dim=8, block_size=16)),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RG-LRU recurrent block",
                        dict(num_hidden_layers=3, lru_width=32, head_dim=8, attention_window_size=16)),
    "mamba": ("MambaForCausalLM", "Mamba-1", dict(num_hidden_layers=2, state_size=8)),
    "falcon_mamba": ("FalconMambaForCausalLM", "Mamba-1", dict(num_hidden_layers=2, state_size=8)),
    "mamba2": ("Mamba2ForCausalLM", "Mamba-2",
               dict(num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=16)),
    "rwkv": ("RwkvForCausalLM", "RWKV time mixing", dict(num_hidden_layers=2, attention_hidden_size=32,
                                                         context_length=64)),
    "xlstm": ("xLSTMForCausalLM", "mLSTM", dict(num_blocks=2, embedding_dim=32, num_heads=4)),
}


def _tiny(arch: str):
    """A tiny random model of a refused family, with transformers' default attention (the RNNs take no sdpa)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**_COMMON, **REFUSED[arch][2]})).eval()


def test_the_refused_table_is_this_files():
    assert set(REFUSED) == set(REFUSED_KINDS) and not set(REFUSED) & set(LAYER_KINDS)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_a_refused_family_is_one_line_naming_it_and_its_layer_kind(arch):
    name, kind, _ = REFUSED[arch]
    model = _tiny(arch)
    assert is_hybrid(model) or arch in ("rwkv", "xlstm")  # RWKV and xLSTM configs name no layer types
    with pytest.raises(ValueError) as err:
        SpeculativeGenerator(model, NgramDrafter())
    message = str(err.value)
    assert message.startswith(f"{name} ({arch}): its {kind} layers are not supported") and "\n" not in message
    with pytest.raises(ValueError, match=f"its {kind} layers"):
        check_supported(model.config)  # the config alone, before any weights load


def test_refused_before_loading_at_every_entry_point(tmp_path, capsys):
    """from_pretrained, scripts/benchmark.py (exit code 2, one line) and training setup, on a saved Mamba."""
    tokenizer = train_tokenizer(train_fixtures.source_texts(), vocab_size=300)
    _tiny("mamba").save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    line = r"MambaForCausalLM \(mamba\): its Mamba-1 layers are not supported: the model has no attention layer"
    with pytest.raises(ValueError, match=line):
        SpeculativeGenerator.from_pretrained(str(tmp_path / "target"), lambda target: NgramDrafter(), threads=1)
    capsys.readouterr()
    assert run(benchmark_main, ["--target", str(tmp_path / "target"), "--out", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "".join(err)
    assert any(line.startswith("error: MambaForCausalLM (mamba): its Mamba-1") for line in err), err
    files = train_fixtures.write_text_files(tmp_path)
    with pytest.raises(ValueError, match=line):
        setup(tiny_config(files, tmp_path / "out", "head.kind=eagle3"))


def test_a_stateful_family_the_table_does_not_know_is_refused(monkeypatch):
    """A hybrid outside the table is refused until tested: ZAYA1 (its "hybrid" layers' mask keys are not the
    verify's), and LFM2 with its row taken out."""
    config = AutoConfig.for_model("zaya", **{**_COMMON, "num_hidden_layers": 2, "layer_types": ["hybrid"] * 2,
                                             "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                                             "head_dim": 8, "router_hidden_size": 16})
    with pytest.raises(ValueError, match=r"^ZayaForCausalLM \(zaya\) keeps a recurrent state in its hybrid layers, "
                                         r"a family draftsmith has not verified lossless; supported hybrids: "):
        SpeculativeGenerator(AutoModelForCausalLM.from_config(config).eval(), NgramDrafter())
    model = make_tiny_hybrid("lfm2")
    monkeypatch.delitem(LAYER_KINDS, "lfm2")
    with pytest.raises(ValueError, match=r"^Lfm2ForCausalLM \(lfm2\) keeps a recurrent state in its "
                                         r"conv/full_attention layers, a family draftsmith has not verified lossless"):
        SpeculativeGenerator(model, NgramDrafter())


def test_recurrent_gemma_let_through_is_not_lossless(monkeypatch):
    """Why it is refused: its recurrent blocks keep their state on the module and restart it on any forward of
    several tokens, so a verify is not a continuation (the refusal planted away, greedy identity breaks)."""
    model = _tiny("recurrent_gemma")
    model.generation_config.eos_token_id = None
    monkeypatch.delitem(REFUSED_KINDS, "recurrent_gemma")
    monkeypatch.setitem(LAYER_KINDS, "recurrent_gemma", "RG-LRU recurrent block")
    rng = random.Random(0)
    ids = torch.tensor([[1] + [rng.randrange(3, 96) for _ in range(11)]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32, pad_token_id=0)
    assert not torch.equal(SpeculativeGenerator(model, NgramDrafter(length=5)).generate(ids, max_new_tokens=32), ref)


def test_a_hybrid_without_an_attention_layer_is_one_line():
    """A supported family configured with every layer recurrent ended in transformers' "get_seq_length can only
    be called on Attention layers" mid-decode."""
    model = make_tiny_hybrid("qwen3_5_text", num_layers=2)
    model.config.layer_types = ["linear_attention"] * 2
    with pytest.raises(ValueError) as err:
        SpeculativeGenerator(model, NgramDrafter())
    assert "(qwen3_5_text) has no attention layer (layer types: linear_attention)" in str(err.value)
    assert "\n" not in str(err.value)
    SpeculativeGenerator(make_tiny_hybrid("qwen3_5_text"), NgramDrafter())  # one attention layer in 8: decodes


@pytest.mark.parametrize("arch", ["mamba", "minimax"])
def test_a_refused_family_as_the_draft_lm_is_one_line(arch):
    from draftsmith.infer.drafters.free.lm_drafter import LMDrafter

    target = make_tiny_hybrid("qwen3_5_text")
    with pytest.raises(ValueError, match=f"its {REFUSED[arch][1]} layers are not supported"):
        SpeculativeGenerator(target, LMDrafter(_tiny(arch), target))


def test_a_tree_drafter_on_a_hybrid_is_refused_up_front():
    """NgramDrafter(branches=3) decoded one prompt and died on another, the first time two continuations matched."""
    from draftsmith.infer.drafters.free.lookup_first import LookupFirst

    target = make_tiny_hybrid("qwen3_5_text")
    for drafter in (NgramDrafter(branches=3), LookupFirst(NgramDrafter(), NgramDrafter(branches=2))):
        with pytest.raises(ValueError, match=r"NgramDrafter\(branches=\d\) drafts trees; a hybrid target"):
            SpeculativeGenerator(target, drafter)
    SpeculativeGenerator(target, NgramDrafter(branches=1))
    SpeculativeGenerator(make_tiny_target("llama"), NgramDrafter(branches=3))  # attention only: trees verify
