"""Run inside the speculators venv (``python consumer_speculators.py --serve``, one request per line; see ``serve``): load an export with
the speculators library's own ``from_pretrained`` and write what it computes. Imports nothing of draftsmith
(its venv pins transformers <= 5.19); ``heads.formats.parity`` builds INPUTS and reads OUT.

EAGLE-3: ``Eagle3DraftModel.forward`` over the given target states (training-time test, ``steps`` steps,
eager attention so it runs on CPU); the ``lm_head`` output of every step is captured, (1, T, Vd) each.
DFlash: ``_backbone_forward`` (the library's block pass) with a loss mask that marks exactly the given
anchors, so it takes all of them (its ``select_anchors`` draws at random only when there are more); the
logits of every block, (1, N·block_size, V). DSpark: the same pass, then its own Markov bias and confidence head
as its ``forward`` applies them (the previous token of slot k is the data's token a+k): the corrected logits
and the confidence logits (N, block_size). P-EAGLE: ``PEagleDraftModel.forward`` with COD sampling keeping every
anchor it can at every depth (ratios 1), its ``lm_head`` output captured, (1, S, Vd), with the anchor and the depth of
each of the S elements as its COD sampling drew them (at depth 1 it leaves out one random position). Every kind also writes the loaded tensors back (``state.*``).
"""
import json
import os
import sys
import traceback

import torch
from safetensors.torch import load_file, save_file


def main(export: str, inputs_path: str, out_path: str, verifier: str) -> None:
    from speculators import SpeculatorModel
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    kind = json.load(open(f"{export}/config.json"))["speculators_model_type"]
    inputs = load_file(inputs_path)
    from speculators.models.dspark import DSparkSpeculatorConfig
    from speculators.models.peagle import PEagleSpeculatorConfig

    config_class = {"eagle3": Eagle3SpeculatorConfig, "dspark": DSparkSpeculatorConfig,
                    "peagle": PEagleSpeculatorConfig}.get(kind, DFlashSpeculatorConfig)
    config = config_class.from_pretrained(export)
    config.speculators_config.verifier.name_or_path = verifier  # a local copy of the target: it reads its weights
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(export, config=config).float().eval()
    out = {f"state.{k}": v.contiguous() for k, v in model.state_dict().items()}
    ids = inputs["input_ids"]
    with torch.no_grad():
        if kind == "peagle":
            out.update(_peagle(model, config, inputs))
        elif kind == "eagle3":
            steps: list[torch.Tensor] = []
            model.lm_head.register_forward_hook(lambda module, args, output: steps.append(output.detach().clone()))
            model(hidden_states=inputs["hidden_states"].float(), input_ids=ids, document_ids=torch.zeros_like(ids),
                  position_ids=inputs["position_ids"], ttt_steps=int(inputs["steps"]))
            out.update({f"step{k}": t.contiguous() for k, t in enumerate(steps)})
        else:
            anchors = inputs["anchors"]
            loss_mask = torch.zeros_like(ids)
            loss_mask[0, anchors] = 1
            verifier_states = torch.zeros(*ids.shape, config.transformer_layer_config.hidden_size)  # loss targets only
            hidden, logits, _, _, index = model._backbone_forward(
                inputs["hidden_states"].float(), ids, loss_mask, verifier_states, torch.zeros_like(ids),
                inputs["position_ids"], max_anchors=anchors.numel())
            if kind == "dspark":
                blocks = (anchors.numel(), config.block_size)
                prev = ids[0, index].view(blocks)
                embedded = model.markov_head.prev_embeddings(prev)
                hidden = hidden.view(*blocks, -1)
                logits = logits.view(*blocks, -1) + model.markov_head.block_bias(
                    prev_token_ids=prev, hidden_states=hidden, prev_emb=embedded)
                out["confidence"] = model.confidence_head(torch.cat([hidden, embedded], -1)).contiguous()
            out["blocks"] = logits.contiguous()
    save_file(out, out_path)


def _peagle(model, config, inputs) -> dict[str, torch.Tensor]:
    """The library's P-EAGLE forward with COD ratios 1: its logits (1, S, Vd), each element's anchor and depth."""
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config

    drawn, original = {}, core.generate_cod_sample_indices

    def recording(*args, **kwargs):
        drawn["anchors"], drawn["depth"] = original(*args, **kwargs)
        return drawn["anchors"], drawn["depth"]

    core.generate_cod_sample_indices = recording  # restored below: the process serves further requests
    captured: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach().clone()))
    ids = inputs["input_ids"]
    width = config.transformer_layer_config.hidden_size
    try:
        model(hidden_states=inputs["hidden_states"].float(), input_ids=ids, document_ids=torch.zeros_like(ids),
              verifier_last_hidden_states=torch.zeros(*ids.shape, width), num_depths=int(inputs["steps"]),
              down_sample_ratio=1.0, down_sample_ratio_min=1.0,
              loss_config=resolve_loss_config("kl_div", "eager"))  # its default fused loss needs Triton (no CPU)
    finally:
        core.generate_cod_sample_indices = original
    return {"depths": captured[0].contiguous(), **{k: v.contiguous() for k, v in drawn.items()}}


def serve() -> None:
    """One request per stdin line, a JSON list ``[EXPORT, INPUTS, OUT, VERIFIER]``; one answer line each, ``ok`` or
    ``error: <the exception, one line>``, so a caller checking many exports pays the library's import (about
    10 s) once. Whatever the library prints goes to stderr: stdout carries only the answers."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        try:
            main(*json.loads(line))
            answer = "ok"
        except Exception as err:  # noqa: BLE001 (the caller names the export and shows this line)
            answer = "error: " + " | ".join(traceback.format_exception_only(err)).replace("\n", " ").strip()
        print(answer, file=answers, flush=True)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main(*sys.argv[1:5])
