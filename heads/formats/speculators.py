"""EAGLE-3 in vLLM's speculators flavour (format ``speculators``): ``vllm serve DIR`` finds the verifier and
proposal length in the config; the layer is ``layers.0.*`` as in the speculators library's checkpoints."""
from __future__ import annotations

from typing import Any

from heads.eagle3 import Eagle3Head
from heads.formats.eagle3 import _eagle3_tensors, eagle31_flags
from heads.formats.validation import Artifact, PROVENANCE_KEY, dtype_name, expect, llama_layer_config, provenance_record


SPECULATORS_LAYER_PREFIX = "layers.0."  # the speculators library's Eagle3DraftModel.layers[0]


def _speculators_artifact(head: Eagle3Head, facts: dict[str, Any], options: dict[str, Any]) -> Artifact:
    """vLLM speculators flavour: `vllm serve DIR` finds the verifier and the proposal length itself.

    The speculators library's ``Eagle3DraftModel`` names its decoder layer ``layers.0`` (vLLM accepts
    both names, the library only its own), so the layer is renamed from the public ``midlayer``.
    """
    cfg = head.config
    tensors = {SPECULATORS_LAYER_PREFIX + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v
               for k, v in _eagle3_tensors(head, options).items()}
    dtype = dtype_name(tensors)
    if not facts["name_or_path"]:
        raise ValueError("the speculators format names its verifier: the head records no target by Hub id (a "
                         "local path is not written into exports); pass target= (--target) a config or model "
                         "whose name_or_path is its Hub id")
    tokens = options["num_speculative_tokens"]
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an int >= 1, got {tokens!r}")
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": llama_layer_config(head, options),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "norm_before_residual": False,  # explicit: vLLM's speculators path defaults it to True
        "norm_before_fc": False,
        **eagle31_flags(cfg),
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "verifier": {"name_or_path": facts["name_or_path"],
                         "architectures": [facts["architecture"]] if facts["architecture"] else []},
        },
        "torch_dtype": dtype,
        "dtype": dtype,
        PROVENANCE_KEY: provenance_record(head, "speculators", facts),
    }
    return Artifact(config, tensors)


def _speculators_problems(config: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    expect(config, "speculators_model_type", "eagle3", problems)
    expect(config, "architectures", ["Eagle3Speculator"], problems)
    if config.get("norm_before_residual") is not False:
        problems.append("norm_before_residual must be written as false (vLLM's speculators path defaults to true)")
    if not config.get("eagle_aux_hidden_state_layer_ids"):
        problems.append("eagle_aux_hidden_state_layer_ids must be written (vLLM's speculators path passes it on)")
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        problems.append(f"speculators_config.proposal_methods[0].speculative_tokens={tokens!r}, expected an int >= 1")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        problems.append("speculators_config.verifier.name_or_path is empty (`vllm serve DIR` loads it as the target)")
    return problems
