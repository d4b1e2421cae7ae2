"""EAGLE-3 head: fused multi-layer target features, a 2H-wide attention input, a reduced vocabulary.

Features are the residual-stream states *entering* target layers ``aux_layer_ids`` (HF
hidden_states indices, default [2, L//2, L-3]), concatenated low→high and fused by ``fc`` (step 0
only). The decoder layer attends over ``concat(input_layernorm(embed(tok)), hidden_norm(hidden))``;
the un-normed output is fed back as the next step's hidden state, and draft logits are
``lm_head(norm(out))`` over ``draft_vocab_size`` tokens, mapped to target ids by ``d2t`` offsets.
Parameter names match the public EAGLE-3 layout (``midlayer.*``) so export is a pure rename-free copy.

EAGLE-3.1's two flags (docs/design.md): ``fc_norm`` adds an RMSNorm per aux layer, applied to its
chunk before ``fc`` (tensors ``fc_norm.{i}.weight``); ``norm_output`` feeds ``norm(out)`` forward
instead of ``out`` (the logits are ``lm_head`` of that same post-norm state; no new tensors).

``variant="peagle"`` (P-EAGLE, ``heads.variants.peagle``): the same layer drafts K tokens in one forward, K-1 of them
at mask positions reading two learned inputs (``mask_hidden``, ``mask_embedding``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.data.base.checks import count
from draftsmith.heads.common import DraftHead, check_variant, final_norm_scale, refuse_variant_options
from draftsmith.heads.eagle import EagleConfig, EagleHead
from draftsmith.heads.layers import MLP, Attention, HeadCache, HeadOutput, RMSNorm, Rotary


VARIANTS = ("eagle3", "peagle")
# the kind's options only one of its variants takes (the variant's class, heads.variants, reads them)
VARIANT_OPTIONS = {"mask_token_id": "peagle", "num_depths": "peagle"}
AUX_LAYERS = 3  # vLLM, SGLang and TensorRT-LLM size the fc for 3 x target_hidden_size, whatever the config says


def engine_aux_layer_ids(num_layers: int) -> list[int]:
    """The layers vLLM, SGLang and TensorRT-LLM capture when a config names none: ``[2, L//2, L-3]``."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high feature layers as HF hidden_states indices.

    The engines' rule ``[2, L//2, L-3]`` where it gives 3 distinct layers of the target (L >= 7);
    below that it repeats or leaves the target ([2, 2, 2] at L=5, [2, 1, -1] at L=2), so small targets
    get ``[1, L//2, L-1]`` (L = 4..6) or ``[0, 1, 2]`` (L = 3), written explicitly into exports.
    """
    ids = engine_aux_layer_ids(num_layers)
    if len(set(ids)) == AUX_LAYERS and all(0 <= i < num_layers for i in ids):
        return ids
    if num_layers < AUX_LAYERS:
        raise ValueError(f"EAGLE-3 fuses {AUX_LAYERS} distinct target layers; this target has fewer than 3 "
                         f"({num_layers}); train an EAGLE (head.kind=eagle) or Medusa head for it")
    return [0, 1, 2] if num_layers == 3 else [1, num_layers // 2, num_layers - 1]


def check_aux_layer_ids(ids: list[int], num_layers: int = 0) -> None:
    """Refuse aux layer ids the engines cannot load: not exactly 3, repeated, or outside the target."""
    if len(ids) != AUX_LAYERS:
        raise ValueError(f"aux_layer_ids {list(ids)}: EAGLE-3 fuses exactly {AUX_LAYERS} layers (vLLM, SGLang and "
                         f"TensorRT-LLM size the fc for {AUX_LAYERS} x the target's hidden size)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux_layer_ids {list(ids)} repeats a layer; name {AUX_LAYERS} distinct layers")
    if any(i < 0 for i in ids):
        raise ValueError(f"aux_layer_ids {[i for i in ids if i < 0]} are negative (hidden_states indices start at 0)")
    bad = [i for i in ids if num_layers and i >= num_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} are outside the target's layers 0..{num_layers - 1}")


def check_draft_temperature(value) -> list[float] | None:
    """A config's ``draft_temperature``: None, or a non-empty list of finite numbers > 0 (one per draft depth);
    anything else refused in one line naming the value."""
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or not value
            or any(isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf") for s in value)):
        raise ValueError(f"draft_temperature must be null or a non-empty list of finite numbers > 0 (one per draft "
                         f"depth), got {value!r}")
    return [float(s) for s in value]


class Eagle3Config(EagleConfig):
    """EAGLE-3 head config (layer fields as ``EagleConfig``).

    Args:
        aux_layer_ids: HF hidden_states indices of the fused target features (state entering
            layer k); default ``[2, L//2, L-3]`` of the target's L layers.
        draft_vocab_size: size of the draft vocabulary; ``None`` or the target's vocab size
            means the full vocabulary (then no ``d2t``/``t2d`` buffers exist).
        fc_norm: EAGLE-3.1: an RMSNorm per aux layer on its chunk before ``fc``.
        norm_output: EAGLE-3.1: the next step (and lm_head) read ``norm(out)``, not ``out``.
        variant: ``"eagle3"``, or ``"peagle"``: P-EAGLE's parallel drafting (``heads.variants.peagle``).
        mask_token_id: P-EAGLE: the token id the speculators layout and vLLM embed at mask positions
            (``pard_token``); None = ``vocab_size - 1``.
        num_depths: P-EAGLE: drafts per forward K (mask positions K-1), trained and drafted; None = 8.
        draft_temperature: per draft depth, what a sampled draft divides the head's logits by before the
            serving temperature (fitted on held-out rows at each evaluation in training, docs/objectives.md; deeper
            drafts use the last); None = 1 at every depth. Greedy drafts do not read it.
    """

    model_type = "draftsmith_eagle3"
    head_kind = "eagle3"
    variants = VARIANTS  # the kind's variants: its own name first
    variant_owners = VARIANT_OPTIONS  # the options only one of the kind's variants takes, and that variant
    variant = "eagle3"  # the variant this class builds (an instance keeps it as a field: config.json's ``variant``)

    def __init__(self, aux_layer_ids: list[int] | None = None, draft_vocab_size: int | None = None,
                 fc_norm: bool = False, norm_output: bool = False, variant: str | None = None,
                 mask_token_id: int | None = None, num_depths: int | None = None,
                 draft_temperature: list[float] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.draft_temperature = check_draft_temperature(draft_temperature)
        self._set_variant(variant, mask_token_id, num_depths, fc_norm or norm_output)
        for name, value in (("fc_norm", fc_norm), ("norm_output", norm_output)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        self.fc_norm, self.norm_output = fc_norm, norm_output
        layers = self.target_num_layers
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else (default_aux_layer_ids(layers) if layers else [])
        # None: the target's whole vocabulary; 0 is no size (refused, never the default)
        self.draft_vocab_size = self.vocab_size if draft_vocab_size is None else count("draft_vocab_size", draft_vocab_size)
        self.fc_bias = False
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        if self.aux_layer_ids:
            check_aux_layer_ids(self.aux_layer_ids, layers)

    def _set_variant(self, variant: str | None, mask_token_id: int | None, num_depths: int | None,
                     eagle31: bool) -> None:
        """The variant this class builds (``check_variant``); the options its variants own stay None here (a
        variant's class, ``heads.variants``, sets its own)."""
        self.variant = check_variant(type(self), variant, VARIANTS)
        self.mask_token_id = self.num_depths = None
        refuse_variant_options(self.variant, {"mask_token_id": mask_token_id, "num_depths": num_depths},
                               VARIANT_OPTIONS)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    @property
    def is_peagle(self) -> bool:
        """Whether this config is P-EAGLE's (``heads.variants.peagle.PEagleConfig`` says so)."""
        return False


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, in_features=2 * h, layer_idx=0)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, hidden: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: HeadCache | None
    ) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        hidden = hidden + self.self_attn(x, cos, sin, mask, cache)  # residual is the un-normed hidden
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# EAGLE-3.1's flags that SGLang's LlamaForCausalLMEagle3 as read for docs/export-keys.md (commit d737979) ignores:
# it feeds the pre-norm state forward and skips the fc_norm tensors, without a word. `--to sglang` refuses such a head.
SGLANG_UNREAD = ("fc_norm", "norm_output")


class Eagle3Head(DraftHead):
    config_class = Eagle3Config
    config_from_target = classmethod(EagleHead.config_from_target.__func__)  # its layer mirrors a target layer
    _no_split_modules = ["Eagle3DecoderLayer"]

    title = "EAGLE-3"
    reads_formats = ("vllm", "sglang", "speculators")

    def card_input_lines(self, export_config: dict[str, Any] | None) -> list[str]:
        cfg = self.config
        ids = list(cfg.aux_layer_ids)
        lines = [
            f"- aux layers **{ids}** as HF `output_hidden_states` indices: the residual stream *entering* layer k "
            "(0 = embeddings). This is the convention of draftsmith and of vLLM's top-level "
            "`eagle_aux_hidden_state_layer_ids`.",
            f"- in the *output of layer k* convention of SGLang (`eagle_config.eagle_aux_hidden_state_layer_ids`) and "
            f"TensorRT-LLM (`eagle3_layers_to_capture`) the same layers are **{[i - 1 for i in ids]}**.",
            f"- draft vocabulary: {cfg.draft_vocab_size} of the target's {cfg.vocab_size} tokens"
            + (" (`d2t` offsets: target id = draft id + d2t[draft id]; `t2d` marks the draft tokens)"
               if cfg.reduced_vocab else " (the full vocabulary; no d2t/t2d)"),
            *self._variant_input_lines(),
        ]
        if export_config is None:
            return lines
        if "eagle_config" in export_config:
            lines.append(f"- this export writes `eagle_aux_hidden_state_layer_ids: {ids}` and "
                         f"`eagle_config.eagle_aux_hidden_state_layer_ids: {[i - 1 for i in ids]}`, each in its "
                         "engine's convention")
        elif "speculators_model_type" in export_config:
            lines.append(f"- this export writes `eagle_aux_hidden_state_layer_ids: {ids}` (vLLM's convention)")
        else:
            lines.append("- this export writes no layer ids: they equal every engine's default [2, L//2, L-3] for "
                         f"this {cfg.target_num_layers}-layer target, which each engine computes itself")
        return lines

    def card_serving_lines(self, served: str, serve_dir: str, export_step, fmt: str | None) -> list[str]:
        lines = ["vLLM:", "", *export_step("vllm"), "```bash",
                 f"vllm serve {served} --speculative-config "
                 f"'{{\"method\": \"eagle3\", \"model\": \"{serve_dir}\", \"num_speculative_tokens\": 3}}'", "```", ""]
        if fmt == "speculators":
            return lines
        unread = [f"`{key}`" for key in SGLANG_UNREAD if getattr(self.config, key)]
        if unread:  # EAGLE-3.1: the SGLang reader checked decodes another head; TensorRT-LLM's was not read
            return lines + [f"SGLang and TensorRT-LLM: this head sets {' and '.join(unread)} (EAGLE-3.1), which "
                            "SGLang's EAGLE-3 drafter at commit d737979 does not read (it would decode a plain EAGLE-3 "
                            "head from these weights) and TensorRT-LLM's reader was not checked for; serve this "
                            "directory only with a version that reads the flags.", ""]
        ids, layers = list(self.config.aux_layer_ids), self.config.target_num_layers
        # TensorRT-LLM's default {1, L//2 - 1, L - 4} (output of layer k) is engine_aux_layer_ids
        capture = [] if layers and ids == engine_aux_layer_ids(layers) else \
            [f"  eagle3_layers_to_capture: {[i - 1 for i in ids]}  # output of layer k"]
        return lines + ["SGLang:", "", *export_step("sglang"), "```bash",
                        f"python -m sglang.launch_server --model-path {served} --speculative-algorithm EAGLE3 "
                        f"--speculative-draft-model-path {serve_dir} --speculative-num-steps 5 "
                        "--speculative-eagle-topk 8 --speculative-num-draft-tokens 32", "```", "",
                        "TensorRT-LLM (PyTorch backend): `trtllm-serve " + served + " --config spec.yaml` with", "",
                        "```yaml", "speculative_config:", "  decoding_type: Eagle3", "  max_draft_len: 3",
                        f"  speculative_model: {serve_dir}", *capture, "```", ""]

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        target_width = config.target_hidden_size or config.hidden_size
        if not config.aux_layer_ids:
            raise ValueError("Eagle3Config.aux_layer_ids is empty; set it or target_num_layers")
        self.fc = nn.Linear(len(config.aux_layer_ids) * target_width, config.hidden_size, bias=False)
        if config.fc_norm:  # EAGLE-3.1: one norm per fused layer, before fc
            self.fc_norm = nn.ModuleList(RMSNorm(target_width, config.rms_norm_eps) for _ in config.aux_layer_ids)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        if config.reduced_vocab:
            # Until set_draft_vocab() is called, the draft vocabulary is the first Vd target ids.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
        self.rotary = Rotary(config.head_dim, config.rope_config)
        self._add_variant_modules(target_width)
        self.post_init()

    def _variant_input_lines(self) -> list[str]:
        """What a variant adds to the card's input lines (none for EAGLE-3)."""
        return []

    def _add_variant_modules(self, target_width: int) -> None:
        """A variant's own modules, registered before ``post_init`` (none for EAGLE-3)."""

    @property
    def feature_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.config.aux_layer_ids)

    def project(self, aux_hidden: Tensor) -> Tensor:
        """Fuse the target's aux features (B, T, n·H_t) into the head's width (B, T, H)."""
        if self.config.fc_norm:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux_hidden)

    def forward(
        self,
        hidden_states: Tensor,  # (B, T, H): project(aux) at step 0, then the head's own output
        inputs_embeds: Tensor,  # (B, T, H): target embedding of the next token
        position_ids: Tensor,  # (B, T)
        attention_mask: Tensor | None = None,  # additive (B, 1, T, S) or None = causal
        past_key_values: HeadCache | None = None,
    ) -> HeadOutput:
        cos, sin = self.rotary(position_ids, hidden_states.dtype)
        out = self.midlayer(hidden_states, inputs_embeds, cos, sin, attention_mask, past_key_values)
        if self.config.norm_output:  # EAGLE-3.1: the next step reads the post-norm state
            out = self.norm(out)
        return HeadOutput(hidden_states=out, past_key_values=past_key_values)  # un-normed unless norm_output

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """Draft-vocabulary logits (B, T, Vd) of a ``forward`` output (normed there under norm_output)."""
        return self.lm_head(hidden_states if self.config.norm_output else self.norm(hidden_states))

    def check_indices(self, where: object = "") -> None:
        """Also the draft vocabulary map: every target id ``arange(Vd) + d2t`` in [0, vocab_size) and
        marked in ``t2d`` (an id outside would be gathered only when a prompt drafts it)."""
        super().check_indices(where)
        if not self.config.reduced_vocab:
            return
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        ids = torch.arange(vd, device=self.d2t.device) + self.d2t  # (Vd,) target ids
        bad = ((ids < 0) | (ids >= v)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"{where}: d2t[{i}]={int(self.d2t[i])} maps draft id {i} to target id {int(ids[i])}, "
                             f"outside [0, {v - 1}] (target id = draft id + d2t[draft id])")
        if int(self.t2d.sum()) != vd or not bool(self.t2d[ids.to(self.t2d.device)].all()):
            raise ValueError(f"{where}: t2d marks {int(self.t2d.sum())} tokens, not the {vd} target ids d2t reaches")

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target ids (identity for a full vocabulary)."""
        if not self.config.reduced_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: Tensor | list[int]) -> None:
        """Use these target ids (strictly increasing, ``draft_vocab_size`` of them) as the draft vocabulary."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if not self.config.reduced_vocab:
            if not torch.equal(ids, torch.arange(v)):
                raise ValueError("a full-vocabulary head's draft vocabulary is all target ids in order")
            return
        if ids.numel() != vd:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, expected draft_vocab_size={vd}")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary ids must be strictly increasing (sorted target ids)")
        if int(ids[0]) < 0 or int(ids[-1]) >= v:
            raise ValueError(f"draft vocabulary ids must lie in [0, {v}), got {int(ids[0])}..{int(ids[-1])}")
        self.d2t.copy_(ids - torch.arange(vd, device=ids.device).to(ids))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    @torch.no_grad()
    def init_from_target(self, target: nn.Module, temper: float = 1.0) -> None:
        """Start ``lm_head`` as the target's lm_head rows of the draft vocabulary and ``norm`` as the
        target's final norm times ``temper`` (call after ``set_draft_vocab``). The head then ranks
        tokens with the target's own output layer and only has to learn features that fit it; the
        weights stay trainable and are exported like any others. ``temper`` < 1 narrows the first
        logits (which token ranks first is unchanged): training chooses it by measurement
        (``train.objectives.eagle3``), since the target's output layer can turn the head's first,
        arbitrary features into confident, wrong logits.
        """
        weight = target.get_output_embeddings().weight  # (V, H_t)
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"target lm_head has shape {tuple(weight.shape)}; this EAGLE-3 head's hidden_size and "
                f"vocab_size need {expected} to start from it"
            )
        if not 0 < temper <= 1:
            raise ValueError(f"temper must lie in (0, 1], got {temper}")
        rows = self.draft_vocab_ids().to(weight.device)
        self.lm_head.weight.copy_(weight.index_select(0, rows).to(self.lm_head.weight))
        self.norm.weight.copy_((final_norm_scale(target, self.config.hidden_size, "start the EAGLE-3 head from random weights instead "
                                               "(head.init_from_target=false)") * temper).to(self.norm.weight))

    def draft_vocab_ids(self) -> Tensor:
        """Target ids of the draft vocabulary, (Vd,) sorted."""
        return self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.lm_head.weight.device))
