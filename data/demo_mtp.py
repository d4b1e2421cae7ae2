"""``demo:tiny-mtp``: a small dense Mellum trained jointly with one multi-token-prediction (MTP) layer, as
DeepSeek-V3 and Qwen3-Next train theirs: loss = LM cross-entropy + ``mtp_loss_weight`` (0.3, DeepSeek-V3's
lambda) x the MTP layer's cross-entropy on the token two ahead. The MTP layer is transformers' own ``MtpModel``
(``modeling_layers``): it reads the trunk's final post-norm state h_i and the embedding of t_{i+1}, and the
trunk's lm_head turns its output into the law of t_{i+2}; the gradient of its loss reaches the trunk too.

The checkpoint carries the MTP layer in ``model.safetensors`` under Mellum's release names (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``, ``mtp.layers.0.*``), the names
transformers' ``MtpModel`` conversion reads (``conversion_mapping.py``, its Mellum entries): a plain
``from_pretrained`` ignores them (Mellum's ``_keys_to_ignore_on_load_unexpected = [r"^mtp\\."]``) and
``generate(use_mtp=True)`` drafts with them.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.modeling_layers import MtpModel

# MtpModel's parameter names (layer 0) -> Mellum's checkpoint names (transformers' conversion_mapping, "MtpModel")
_MELLUM_OWN = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "post_norm": "norm"}


def mellum_fields(settings) -> dict:
    """The MellumConfig fields of a dense demo Mellum with one full-attention, dense MTP layer."""
    n = settings.num_layers
    return dict(head_dim=settings.hidden_size // settings.num_heads, layer_types=["full_attention"] * n,
                mlp_layer_types=["dense"] * n, num_mtp_layers=1, mtp_layer_types=["full_attention"],
                mtp_mlp_layer_types=["dense"])


class JointMtp(nn.Module):
    """The trunk (``lm``, a MellumForCausalLM) and its MTP layer (``mtp``, transformers' MtpModel sharing the
    trunk's embedding and lm_head), called as the demo recipe calls a causal LM: ``(input_ids, labels).loss``."""

    def __init__(self, lm: nn.Module, weight: float) -> None:
        super().__init__()
        self.lm = lm
        self.mtp = MtpModel(lm, 1)
        self.weight = weight

    def losses(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM cross-entropy on t_{i+1}, MTP cross-entropy on t_{i+2}), both means over their positions."""
        hidden = self.lm.model(input_ids=input_ids).last_hidden_state  # (B, T, H) post-norm
        logits = self.lm.lm_head(hidden)[:, :-1]
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))
        positions = torch.arange(1, input_ids.shape[1], device=input_ids.device)[None]  # those of t_{i+1}
        out = self.mtp.forward_layer(0, hidden[:, :-1], positions, None, input_ids=input_ids[:, 1:])
        mtp_logits = self.mtp._project_to_logits(out[:, :-1])
        mtp = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]).float(), input_ids[:, 2:].reshape(-1))
        return lm, mtp

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        lm, mtp = self.losses(input_ids)
        return SimpleNamespace(loss=lm + self.weight * mtp, lm_loss=lm, mtp_loss=mtp)


@torch.no_grad()
def heldout_mtp_loss(joint: JointMtp, blocks: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """The MTP layer's mean cross-entropy (nats/token) on t_{i+2} over the held-out blocks."""
    joint.eval()
    total, n = 0.0, 0
    for batch in blocks.split(batch_size):
        count = batch[:, 2:].numel()
        total += joint.losses(batch.to(device))[1].item() * count
        n += count
    return total / n


def mellum_mtp_tensors(mtp: MtpModel) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under Mellum's checkpoint names (the shared embedding and lm_head left out)."""
    out = {}
    for name, value in mtp.layers[0].state_dict().items():
        own, rest = name.split(".", 1)
        if own == "mtp_block":
            out[f"mtp.layers.0.{rest}"] = value
        else:
            out[f"mtp.{_MELLUM_OWN[own]}.{rest}"] = value
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def add_mtp_tensors(out_dir: Path, mtp: MtpModel) -> None:
    """Write the MTP layer into the saved ``model.safetensors`` of ``out_dir`` (one file, as the demo LMs save)."""
    path = Path(out_dir) / "model.safetensors"
    tensors = load_file(str(path))
    clash = sorted(k for k in tensors if k.startswith("mtp."))
    if clash:
        raise ValueError(f"{path} already holds MTP tensors ({clash[:3]}): not a fresh save")
    save_file({**tensors, **mellum_mtp_tensors(mtp)}, str(path), metadata={"format": "pt"})
