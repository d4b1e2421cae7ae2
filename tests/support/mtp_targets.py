"""Tiny targets whose checkpoints carry MTP layers as the releases do (DeepSeek-V3: ``model.layers.{L}.*``;
Qwen3-Next: ``mtp.*``), in a second shard named by ``model.safetensors.index.json``, and an independent
reference of each MTP layer's math (Mellum: ``mtp.*`` as Qwen3-Next, plain norms, a sliding-attention MoE
MTP layer as its release config says): the decoder block comes from transformers itself (the same checkpoint
loaded as an (L+1)-layer model, whose last layer is the MTP block), the rest written out here from the
engines' formulas (vLLM ``deepseek_mtp.py`` / ``qwen3_next_mtp.py``, docs/mtp.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from support.hybrids import _COMMON, _GDN

_DEEPSEEK = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                 topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                 qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4, initializer_range=0.1)
_QWEN_NEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  initializer_range=0.1, **_GDN)
# Mellum as its release: MoE trunk, one MoE MTP layer of sliding attention (the config's defaults), whose RoPE is
# the sliding layers' (theta 1e4, the trunk's full attention 5e5): a head that read the trunk's would differ
_MELLUM = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, initializer_range=0.1,
               sliding_window=64)
_TRUNK_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
STYLES = ("deepseek", "qwen3_next", "mellum")
_FAMILY = {"deepseek": "deepseek_v3", "qwen3_next": "qwen3_next", "mellum": "mellum"}


@dataclass
class MtpTarget:
    model: nn.Module  # the target, loaded from ``folder`` (transformers ignores its MTP tensors)
    folder: Path
    block: nn.Module  # transformers' own decoder layer holding the MTP block's weights
    rotary: nn.Module  # (x, positions) -> (cos, sin) of the MTP layer
    norm_cls: type  # the family's RMSNorm class
    own: dict[str, Tensor]  # enorm, hnorm, eh_proj, post_norm weights, as the checkpoint holds them


def _configs(style: str, vocab: int) -> tuple[dict, dict]:
    """(trunk config, the same with one more layer) as keyword arguments."""
    if style == "deepseek":
        trunk = dict(_COMMON, **_DEEPSEEK, vocab_size=vocab, num_hidden_layers=2, num_nextn_predict_layers=1)
        return trunk, dict(trunk, num_hidden_layers=3)
    if style == "mellum":
        types = ["sliding_attention", "full_attention"]  # as the release interleaves them (transformers' MtpModel
        # takes the trunk's rotary, which must know the MTP layer's type)
        trunk = dict(_COMMON, **_MELLUM, vocab_size=vocab, num_hidden_layers=2, layer_types=types, num_mtp_layers=1)
        full = {k: v for k, v in trunk.items() if k != "num_mtp_layers"}
        return trunk, dict(full, num_hidden_layers=3, layer_types=[*types, "sliding_attention"])
    trunk = dict(_COMMON, **_QWEN_NEXT, vocab_size=vocab, num_hidden_layers=4, layer_types=_TRUNK_TYPES,
                 mtp_num_hidden_layers=1)
    return trunk, dict(trunk, num_hidden_layers=5, layer_types=[*_TRUNK_TYPES, "full_attention"])


def _own_tensors(style: str, hidden: int, generator: torch.Generator) -> dict[str, Tensor]:
    """Random enorm, hnorm, eh_proj, post_norm weights: distinct norms (a swapped pair shows), the zero-centred
    family (Qwen3-Next: 1 + w) near 0, the other near 1."""
    centre = 0.0 if style == "qwen3_next" else 1.0
    norm = [centre + 0.5 * torch.randn(hidden, generator=generator) for _ in range(3)]
    proj = torch.randn(hidden, 2 * hidden, generator=generator) / (2 * hidden) ** 0.5
    return {"enorm": norm[0], "hnorm": norm[1], "eh_proj": proj, "post_norm": norm[2]}


def _release_names(style: str, layers: int, own: dict[str, Tensor], block: dict[str, Tensor],
                   shared: dict[str, Tensor]) -> dict[str, Tensor]:
    """The MTP tensors under a release's names (written out here, apart from draftsmith's mapping)."""
    if style == "deepseek":
        p = f"model.layers.{layers}."
        out = {p + "enorm.weight": own["enorm"], p + "hnorm.weight": own["hnorm"], p + "eh_proj.weight": own["eh_proj"],
               p + "shared_head.norm.weight": own["post_norm"], p + "embed_tokens.weight": shared["embed"],
               p + "shared_head.head.weight": shared["head"]}
        return {**out, **{p + k: v for k, v in block.items()}}
    out = {"mtp.pre_fc_norm_embedding.weight": own["enorm"], "mtp.pre_fc_norm_hidden.weight": own["hnorm"],
           "mtp.fc.weight": own["eh_proj"], "mtp.norm.weight": own["post_norm"]}
    return {**out, **{"mtp.layers.0." + k: v for k, v in block.items()}}


def save_release(folder: Path, config, trunk: dict[str, Tensor], mtp: dict[str, Tensor]) -> nn.Module:
    """Save ``config`` and the tensors as releases do (the trunk's shard, then one holding the MTP layers, with
    their index) in ``folder``; the target loaded from it (fp32, no EOS): transformers ignores the MTP tensors."""
    config.save_pretrained(folder)
    files = {"model-00001-of-00002.safetensors": trunk, "model-00002-of-00002.safetensors": mtp}
    for name, part in files.items():
        save_file({k: v.contiguous() for k, v in part.items()}, str(folder / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in files.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").float().eval()
    model.generation_config.eos_token_id = None
    return model


def make_mtp_target(style: str, folder: Path, *, vocab: int = 96, seed: int = 0, sharpen: float = 1.0) -> MtpTarget:
    """A tiny DeepSeek-V3-style or Qwen3-Next-style target saved in ``folder`` with its MTP layer in a second shard."""
    trunk, full = _configs(style, vocab)
    model_type = _FAMILY[style]
    torch.manual_seed(seed)
    big = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **full), attn_implementation="sdpa")
    big = big.float().eval()
    with torch.no_grad():
        big.get_output_embeddings().weight.mul_(sharpen)
    staging = folder.parent / f"{folder.name}-staging"
    big.save_pretrained(staging)
    tensors = load_file(str(staging / "model.safetensors"))
    layers = trunk["num_hidden_layers"]
    prefix = f"model.layers.{layers}."
    block = {k[len(prefix):]: tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
    own = _own_tensors(style, trunk["hidden_size"], torch.Generator().manual_seed(seed + 1))
    shared = {"embed": tensors["model.embed_tokens.weight"], "head": tensors["lm_head.weight"]}
    mtp = _release_names(style, layers, own, block, shared)
    model = save_release(folder, AutoConfig.for_model(model_type, **trunk), tensors, mtp)
    norm_cls = type(big.model.layers[layers].input_layernorm)
    rotary = big.model.rotary_emb
    if style == "mellum":  # RoPE per layer type: the MTP layer's is the last layer's (sliding attention)
        rotary = partial(big.model.rotary_emb, layer_type=big.config.layer_types[layers])
    return MtpTarget(model, folder, big.model.layers[layers], rotary, norm_cls, own)


def _norm(norm_cls: type, weight: Tensor, x: Tensor, eps: float) -> Tensor:
    norm = norm_cls(weight.shape[0], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


@torch.no_grad()
def reference_mtp(t: MtpTarget, hidden: Tensor, embeds: Tensor, positions: Tensor) -> Tensor:
    """The MTP layer's post-norm output (1, T, H) at every position, causal over the T positions, from
    ``hidden`` (the target's final post-norm states) and ``embeds`` (the next tokens' embeddings)."""
    eps = t.model.config.rms_norm_eps
    x = torch.cat([_norm(t.norm_cls, t.own["enorm"], embeds, eps), _norm(t.norm_cls, t.own["hnorm"], hidden, eps)], -1)
    x = F.linear(x, t.own["eh_proj"])
    x = t.block(x, position_embeddings=t.rotary(x, positions), attention_mask=None, position_ids=positions)
    return _norm(t.norm_cls, t.own["post_norm"], x, eps)


@torch.no_grad()
def reference_chain(t: MtpTarget, ids: Tensor, k: int) -> list[int]:
    """The k greedy drafts after ``ids`` (1, P) that the MTP layer proposes at the last position, chaining its own
    output (each level recomputes the whole prefix: no cache)."""
    model = t.model
    final = model(ids, output_hidden_states=True).hidden_states[-1]  # (1, P, H) post-norm
    root = model(ids).logits[0, -1].argmax()
    tokens = torch.cat([ids[0, 1:], root[None]])  # token after each position
    hidden = final
    drafts = []
    for _ in range(k):
        embeds = model.get_input_embeddings()(tokens[None])
        positions = torch.arange(tokens.shape[0])[None]
        out = reference_mtp(t, hidden, embeds, positions)
        draft = model.get_output_embeddings()(out[0, -1]).argmax()
        drafts.append(int(draft))
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)  # the next level reads its own output
        tokens = torch.cat([tokens, draft[None]])
    return drafts


def tuned_export(style: str, root: Path):
    """(an MTP target of ``style`` under ``root/target``, a tuned head of it (perturbed: not the checkpoint's), the
    head's ``export --to mtp`` folder under ``root/export``)."""
    from support.formats import perturb

    from draftsmith.heads import build_head
    from draftsmith.heads.formats import export_head

    t = make_mtp_target(style, root / "target")
    head = perturb(build_head("mtp", t.model))
    return t, head, export_head(head, root / "export", "mtp", target=t.model)

