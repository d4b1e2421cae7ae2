"""Domino's logit correction on the DFlash backbone (``head.variant=domino``; docs/dflash.md, "Domino").

Domino (arXiv 2605.29707; SpecForge's ``DominoDraftModel``, vLLM's ``DominoQwen3ForCausalLM``, SGLang's
``domino_utils``) reads the block's slots as DSpark does (slot k drafts the token k+1 after the root:
SpecForge's ``shift_label``) and adds to each slot's lm_head logits a correction from the tokens before it:

- ``prefix_gru``: a GRU (input the target's embedding of a token, H -> ``gru_hidden_dim`` G, one layer, no
  bias) run from a zero state over the root and then each token of the block: the state ``s_k`` after
  tokens a..a+k (training: the data's tokens, teacher-forced; drafting: the root, then each drafted token);
- ``embed_proj``: Linear(H + G, ``emb_dim``, no bias) -> SiLU -> Linear(``emb_dim``, V, no bias) of
  ``[h_k ; s_k]`` (h_k the slot's normed output).

Slot k's logits are ``lm_head(h_k) + embed_proj([h_k ; s_k])`` for k >= ``pure_draft_prefix_len`` (SpecForge's
``suffix_start`` with ``shift_label``), ``lm_head(h_k)`` before. The modules' names are the checkpoints'
(``prefix_gru.weight_ih_l0`` / ``weight_hh_l0``, ``embed_proj.0.weight`` / ``embed_proj.2.weight``). Init: the
linears normal(0, initializer_range) (the head's ``post_init``), the GRU PyTorch's U(±1/sqrt(G)), as
SpecForge's (transformers' init does not reach an ``nn.GRU``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.heads.dflash import DFlashConfig, DFlashHead, sglang_dflash_lines

DOMINO_ARCHITECTURE = "DominoDraftModel"  # SpecForge's checkpoints; SGLang's and vLLM's Domino readers take it
DOMINO_PROJECTOR = "domino"  # dflash_config.projector_type (SGLang also accepts "causal_v5")
# SpecForge's configs/qwen3-8b-domino.json: the engines' defaults (docs/dflash.md)
DOMINO_DEFAULTS = {"gru_hidden_dim": 1024, "emb_dim": 256, "pure_draft_prefix_len": 1}


def prefix_gru(hidden_size: int, gru_hidden_dim: int) -> nn.GRU:
    return nn.GRU(hidden_size, gru_hidden_dim, num_layers=1, batch_first=True, bias=False)


def embed_proj(hidden_size: int, gru_hidden_dim: int, emb_dim: int, vocab_size: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden_size + gru_hidden_dim, emb_dim, bias=False), nn.SiLU(),
                         nn.Linear(emb_dim, vocab_size, bias=False))


def gru_step(gru: nn.GRU, embedded: Tensor, state: Tensor | None) -> Tensor:
    """The state (R, G) after one more token, embedded (R, H), from ``state`` (R, G) (None: the zero state)."""
    weight = gru.weight_ih_l0
    h0 = None if state is None else state[None].to(weight.dtype)
    return gru(embedded[:, None].to(weight.dtype), h0)[1][0]


def prefix_states(gru: nn.GRU, embedded: Tensor) -> Tensor:
    """(..., L, G) the states after each token of sequences embedded (..., L, H), each from a zero state."""
    flat = embedded.flatten(0, -3).to(gru.weight_ih_l0.dtype)
    return gru(flat)[0].view(*embedded.shape[:-1], -1)


def correction(proj: nn.Sequential, hidden: Tensor, state: Tensor) -> Tensor:
    """(..., V) float32: ``embed_proj([hidden ; state])`` of slot outputs hidden (..., H) and GRU states (..., G)."""
    features = torch.cat([hidden, state.to(hidden.dtype)], dim=-1)
    return proj(features.to(proj[0].weight.dtype)).float()


class DominoConfig(DFlashConfig):
    """Domino's config: DFlash's fields, ``variant="domino"``, and ``gru_hidden_dim``, ``emb_dim``,
    ``pure_draft_prefix_len`` (None: ``DOMINO_DEFAULTS``)."""

    variant = "domino"
    is_domino = True
    first_draft_slot = 0  # slot k drafts the token k+1 after the root (SpecForge's shift_label)

    def __init__(self, **kwargs):  # its own: transformers makes a config class without one a dataclass
        super().__init__(**kwargs)

    def _set_variant_options(self, given: dict) -> None:
        for key in DOMINO_DEFAULTS:
            setattr(self, key, int(DOMINO_DEFAULTS[key] if given[key] is None else given[key]))
        if self.gru_hidden_dim < 1 or self.emb_dim < 1:
            raise ValueError(f"gru_hidden_dim={self.gru_hidden_dim} and emb_dim={self.emb_dim} must be at least 1 "
                             "(Domino's GRU and correction)")
        if not 0 <= self.pure_draft_prefix_len < self.block_size:
            raise ValueError(f"pure_draft_prefix_len={self.pure_draft_prefix_len} must lie in 0..block_size - 1 = "
                             f"{self.block_size - 1}: Domino corrects at least one slot")


class DominoHead(DFlashHead):
    """The DFlash head with Domino's GRU correction."""

    config_class = DominoConfig
    title = "Domino"
    domino = True

    def _variant_input_lines(self) -> list[str]:
        cfg = self.config
        return [f"- Domino: every slot drafts the token after it ({cfg.block_size} drafts); from slot "
                f"{cfg.pure_draft_prefix_len} on, a correction from a {cfg.gru_hidden_dim}-wide GRU over the tokens "
                f"before the slot (rank-{cfg.emb_dim} projection) is added to its logits"]

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        return sglang_dflash_lines(served, serve_dir, export_step,
                                   "dflash_config.projector_type domino selects the GRU correction; CUDA, greedy")

    def _add_variant_modules(self, config: DFlashConfig) -> None:
        self.prefix_gru = prefix_gru(config.hidden_size, config.gru_hidden_dim)
        self.embed_proj = embed_proj(config.hidden_size, config.gru_hidden_dim, config.emb_dim, config.vocab_size)
