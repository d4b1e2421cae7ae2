"""A tiny DeepSeek-V3-style target whose checkpoint carries two MTP layers (``model.layers.{2,3}.*``, a second
shard named by the index, as releases do), and an independent reference of drafting with several layers:
level s uses layer s % n (vLLM's ``spec_step_idx % num_mtp_layers``), each layer attending to the accepted
context (the target's states) and to the draft positions it produced itself, every level recomputed from
scratch with the decoder blocks of transformers' own (L+2)-layer model (no cache)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM

from support.hybrids import _COMMON
from support.mtp_targets import _DEEPSEEK, _norm, _own_tensors, save_release

TRUNK = 2


@dataclass
class LayersTarget:
    model: nn.Module
    folder: Path
    blocks: list[nn.Module]  # transformers' decoder layers holding each MTP layer's block
    rotary: nn.Module
    norm_cls: type
    own: list[dict[str, Tensor]]  # per MTP layer: enorm, hnorm, eh_proj, post_norm


def make_layers_target(folder: Path, n: int = 2, *, vocab: int = 8, seed: int = 0, sharpen: float = 4.0) -> LayersTarget:
    trunk = dict(_COMMON, **_DEEPSEEK, vocab_size=vocab, num_hidden_layers=TRUNK, num_nextn_predict_layers=n)
    torch.manual_seed(seed)
    big = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **dict(trunk, num_hidden_layers=TRUNK + n)),
                                           attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        big.get_output_embeddings().weight.mul_(sharpen)
    staging = folder.parent / f"{folder.name}-staging"
    big.save_pretrained(staging)
    tensors = load_file(str(staging / "model.safetensors"))
    own = [_own_tensors("deepseek", trunk["hidden_size"], torch.Generator().manual_seed(seed + 1 + i)) for i in range(n)]
    mtp = {}
    for i in range(n):
        p = f"model.layers.{TRUNK + i}."
        mtp.update({k: tensors.pop(k) for k in list(tensors) if k.startswith(p)})
        mtp.update({p + "enorm.weight": own[i]["enorm"], p + "hnorm.weight": own[i]["hnorm"],
                    p + "eh_proj.weight": own[i]["eh_proj"], p + "shared_head.norm.weight": own[i]["post_norm"],
                    p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                    p + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    model = save_release(folder, AutoConfig.for_model("deepseek_v3", **trunk), tensors, mtp)
    blocks = [big.model.layers[TRUNK + i] for i in range(n)]
    return LayersTarget(model, folder, blocks, big.model.rotary_emb, type(blocks[0].input_layernorm), own)


@torch.no_grad()
def _layer(t: LayersTarget, j: int, hidden: Tensor, embeds: Tensor, positions: Tensor) -> Tensor:
    eps = t.model.config.rms_norm_eps
    own = t.own[j]
    x = torch.cat([_norm(t.norm_cls, own["enorm"], embeds, eps), _norm(t.norm_cls, own["hnorm"], hidden, eps)], -1)
    x = t.blocks[j](F.linear(x, own["eh_proj"]), position_embeddings=t.rotary(x, positions), attention_mask=None,
                    position_ids=positions)
    return _norm(t.norm_cls, own["post_norm"], x, eps)


@torch.no_grad()
def reference_layers_chain(t: LayersTarget, ids: Tensor, k: int, pick=lambda s, n: s % n) -> list[Tensor]:
    """The draft logits (V,) of the k greedy levels after ``ids`` (1, P): level s runs layer ``pick(s, n)`` over
    the context and the draft positions that layer ran before, at their true positions."""
    model, n = t.model, len(t.blocks)
    final = model(ids, output_hidden_states=True).hidden_states[-1][0]  # (P, H)
    tokens = torch.cat([ids[0, 1:], model(ids).logits[0, -1].argmax()[None]])  # the token after each position
    p = ids.shape[1]
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    entries = {j: [] for j in range(n)}  # per layer: (hidden, token, position) of the draft levels it ran
    hidden, token, logits = final[-1], tokens[-1], []
    for s in range(k):
        j = pick(s, n)
        if s:
            entries[j].append((hidden, token, p - 1 + s))
        hs = torch.cat([final, *[e[0][None] for e in entries[j]]])[None]
        tok = torch.cat([tokens, torch.stack([e[1] for e in entries[j]]) if entries[j] else tokens[:0]])
        pos = torch.tensor([*range(p), *[e[2] for e in entries[j]]])[None]
        hidden = _layer(t, j, hs, embed(tok)[None], pos)[0, -1]
        logits.append(head(hidden))
        token = logits[-1].argmax()
    return logits
