"""Check an export against its consumer's own code: the drafts it computes must equal the head's.

    draftsmith check-export exports/spec --head runs/demo-eagle3 --target demo:tiny [--install]

The export is validated as its engine reads it (``validate_export``). A ``speculators`` export is then loaded
by speculators 0.9.0's own ``from_pretrained`` (in its venv, ``heads.formats.parity``; ``--install`` creates
it) and run on the same target states as the head: EAGLE-3 drafts every position for ``--steps`` steps
(training-time test, teacher-forced), DFlash drafts a block at every anchor; each step (block position)
prints its max |logit difference| and how many drafted tokens agree, and for DFlash what vLLM's reader
makes of the causal flag. The library drafts from target states we give it, so what selects them (the aux
layer ids vLLM reads) is checked as for every format: the export must be what ``--head`` exports in that
format now (every config key but the recorded target facts, every tensor), so a flipped flag, a changed
block size or layer list, or another head's export exits 1. Formats no consumer library runs here are
checked that way alone (and at config level, docs/export-keys.md). Exit 0 when all agree, 1 on any
mismatch, 2 on a usage error. The venv goes to ``$DRAFTSMITH_VENVS/speculators-0.9.0`` (default
``~/.cache/draftsmith/venvs``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.data.base.checks import cli_count, cli_real
from draftsmith.data.cli import prog, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The check's options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=prog("check_export.py"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="the export directory")
    parser.add_argument("--head", required=True, help="the head the export was written from (ours)")
    parser.add_argument("--target", required=True, help="the target (path, Hub id or demo:<size>); the consumer "
                        "reads it as the verifier")
    parser.add_argument("--steps", type=cli_count(), default=3, help="EAGLE-3 draft steps compared")
    parser.add_argument("--tokens", type=cli_count(), default=24, help="target positions drafted from")
    parser.add_argument("--atol", type=cli_real(0.0), default=1e-4, help="largest logit difference that still agrees")
    parser.add_argument("--python", type=Path, help="an interpreter that imports speculators (default: its venv)")
    parser.add_argument("--install", action="store_true", help="create the speculators venv if it is missing "
                        "(pip, from the package index; in $DRAFTSMITH_VENVS, default ~/.cache/draftsmith/venvs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Validate the export, run its consumer, print one line per step; 0 when all agree, 1 otherwise."""
    args = parse_args(argv)
    if args.tokens <= args.steps:
        raise ValueError(f"--tokens {args.tokens} must exceed --steps {args.steps} (the last --steps positions "
                         "are not compared)")
    if not (args.export / "config.json").is_file():
        raise FileNotFoundError(f"{args.export}/config.json: no such file; is {args.export} an export?")
    # torch, transformers and the heads load only now: an argument mistake above is one line in a second
    from draftsmith.data.targets import load_target, resolve_target
    from draftsmith.heads import AutoHead
    from draftsmith.heads.formats import PROVENANCE_KEY, validate_export
    from draftsmith.heads.formats.parity import speculators_python
    from draftsmith.heads.formats.validation import read_json_object

    config = read_json_object(args.export / "config.json")
    fmt = (config.get(PROVENANCE_KEY) or {}).get("format")
    fmt = "vllm" if fmt == "vllm+sglang" else fmt
    if fmt is None:
        raise ValueError(f"{args.export}/config.json: no draftsmith provenance; not an export draftsmith wrote")
    valid = True
    try:
        validate_export(args.export, fmt)
        print(f"config/tensors: valid '{fmt}' export")
    except ValueError as err:  # a broken export is a mismatch, not a usage error; the consumer still shows its effect
        print(f"config/tensors: MISMATCH {err}".replace("\n", " "))
        valid = False
    head = AutoHead.from_pretrained(args.head).float().eval()
    target_path = resolve_target(args.target)
    if fmt != "speculators":
        return _without_library(head, fmt, args.export, target_path, valid)
    python = args.python or speculators_python(create=args.install)
    target = load_target(target_path).float().eval()
    try:
        run = _dflash if head.head_kind == "dflash" else _peagle if getattr(head.config, "is_peagle", False) else _eagle3
        lines, ok = run(head, target, config, python, args, target_path)
    except RuntimeError as err:  # the library refused the export: that is a mismatch too
        lines, ok = [str(err)], False
    print("\n".join(lines))
    # what the library does not read from the export (our target states stand in for the verifier's layers)
    # is what vLLM does read: the export must also be what --head exports now
    same = _print_head_differences(head, fmt, args.export, target)
    print("parity: ok" if ok and valid and same else "parity: MISMATCH")
    return 0 if ok and valid and same else 1


def _without_library(head, fmt: str, export: Path, target_path, valid: bool) -> int:
    """A format no consumer library runs here: the export against what ``--head`` exports in it."""
    from transformers import AutoConfig

    print(f"no consumer library for '{fmt}' runs here: the keys its engines read are tabled in "
          "docs/export-keys.md (tests/heads/test_export_keys.py checks we write them)")
    ok = _print_head_differences(head, fmt, export, AutoConfig.from_pretrained(target_path)) and valid
    print("export: ok" if ok else "export: MISMATCH")
    return 0 if ok else 1


def _print_head_differences(head, fmt: str, export: Path, target) -> bool:
    """Print what differs between the export and what ``head`` exports as ``fmt`` now (or that nothing
    does); True when nothing does."""
    differences = export_differences(head, export, fmt, target)
    print("\n".join(f"--head: {line} MISMATCH" for line in differences) or f"--head: the export is what "
          f"{head.head_kind} head {getattr(head, 'name_or_path', '') or '--head'} exports as '{fmt}' ok")
    return not differences


def export_differences(head, export: Path, fmt: str, target) -> list[str]:
    """What differs between the export at ``export`` (format ``fmt``) and what ``head`` exports in that format
    now: every config key but the recorded target facts (``target``, a model or its config, fills them) and
    every tensor, compared in the export's own dtype. What the user chose at export (the dtype, the context, a
    speculators export's proposal length and verifier) is read from the export; a target model (not only its
    config) gives the embedding a speculators EAGLE-3 export carries. One line per difference; none when it
    is this head's."""
    import torch

    from draftsmith.heads.formats import FORMATS, _target_facts, _target_weights
    from draftsmith.heads.formats.validation import PROVENANCE_KEY, read_json_object, read_tensors

    config = read_json_object(export / "config.json")
    tensors = read_tensors(export / FORMATS[fmt].weights_file)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    layer = config.get("transformer_layer_config") if isinstance(config.get("transformer_layer_config"), dict) else {}
    context = config.get("max_position_embeddings", layer.get("max_position_embeddings"))
    spec = config.get("speculators_config") if isinstance(config.get("speculators_config"), dict) else {}
    methods = spec.get("proposal_methods")
    proposal = methods[0] if isinstance(methods, list) and methods else {}
    tokens = proposal.get("speculative_tokens") if isinstance(proposal, dict) else None
    options = {"dtype": dtypes.pop() if len(dtypes) == 1 else None,
               "num_speculative_tokens": tokens if isinstance(tokens, int) and tokens >= 1 else 3,
               "max_position_embeddings": context if isinstance(context, int) else head.config.max_position_embeddings,
               **_target_weights(target)}
    facts = _target_facts(head, target)
    verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec.get("verifier"), dict) else None
    if fmt == "speculators" and isinstance(verifier, str) and verifier:
        facts["name_or_path"] = verifier  # written as the user gave it (--verifier)
    try:
        artifact = FORMATS[fmt].build(head, facts, options)
    except ValueError as err:
        return [f"--head cannot be exported as '{fmt}': {err}"]
    ours, theirs = _flat(artifact.config), _flat(config)
    skip = f"{PROVENANCE_KEY}.target."
    lines = [f"config {key}: export {theirs.get(key, '(absent)')!r}, --head writes {ours.get(key, '(absent)')!r}"
             for key in sorted(ours.keys() | theirs.keys())
             if not key.startswith(skip) and _plain(ours.get(key)) != _plain(theirs.get(key))]
    for name in sorted(artifact.tensors.keys() | tensors.keys()):
        mine, other = artifact.tensors.get(name), tensors.get(name)
        if mine is None or other is None:
            lines.append(f"tensor {name}: only in {'the export' if mine is None else '--head'}")
        elif mine.shape != other.shape or not torch.equal(mine.to(other.dtype), other):
            lines.append(f"tensor {name}: differs from --head's" + (
                f" (shape {tuple(other.shape)}, --head {tuple(mine.shape)})" if mine.shape != other.shape else ""))
    return lines


def _flat(config: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    out = {}
    for key, value in config.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _plain(value):
    """A config value as JSON reads it back (tuples as lists)."""
    return json.loads(json.dumps(value))


def _eagle3(head, target, config, python, args, target_path) -> tuple[list[str], bool]:
    """Both sides on the same target states: ``(1, T)`` tokens, their aux features ``(1, T, 3·H_t)``."""
    import torch

    from draftsmith.heads.formats.parity import compare_steps, run_speculators
    from draftsmith.train.unroll import shift_left, unroll

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (1, args.tokens), generator=generator)
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.feature_layer_ids], dim=-1)
        embeds = target.get_input_embeddings()(ids)
        ours = [head.compute_logits(h)[0] for h in unroll(head, head.project(aux), embeds, args.steps)]
    # the library's step k reads input_ids shifted by k: ours reads token i+1+k, so it gets ids shifted by one
    inputs = {"hidden_states": aux, "input_ids": shift_left(ids, 1), "steps": torch.tensor(args.steps),
              "position_ids": torch.arange(args.tokens)[None]}
    out = run_speculators(python, args.export, str(target_path), inputs)
    theirs = [out[f"step{k}"][0] for k in range(args.steps) if f"step{k}" in out]
    keep = args.tokens - args.steps  # the last positions read the padding each side fills its own way
    tensors, same = _tensors(head, out)
    lines, ok = compare_steps([o[:keep] for o in ours], [t[:keep] for t in theirs], args.atol)
    return tensors + lines, same and ok


def _peagle(head, target, config, python, args, target_path) -> tuple[list[str], bool]:
    """P-EAGLE: every depth d at every anchor of the same target states on both sides (the library's COD sampling
    told to keep them all), one line per depth; the tensors, the mask embedding as the export's embed_tokens row."""
    import torch

    from draftsmith.heads.formats.parity import compare_steps, run_speculators
    from draftsmith.train.objectives.variants.peagle import all_rollouts, parallel_outputs
    from draftsmith.train.unroll import shift_left

    depths, length = head.config.num_depths, args.tokens
    ids = torch.randint(3, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.feature_layer_ids], dim=-1)
        outs = parallel_outputs(head, aux, target.get_input_embeddings()(ids), all_rollouts(ids, depths))
        ours = [head.compute_logits(out)[0] for out in outs]  # depth d: (T, Vd), anchor a at row a
    inputs = {"hidden_states": aux, "input_ids": shift_left(ids, 1), "steps": torch.tensor(depths)}
    out = run_speculators(python, args.export, str(target_path), inputs)
    anchors, drawn, theirs = out["anchors"], out["depth"], out["depths"][0]
    # each element of the library's at an anchor inside the row; depth 0's last reads the padding each side fills its
    # own way (the library's input_ids shifted left end in token 0, ours in a zero embedding)
    chosen = [(drawn == d) & (anchors >= 0) & (anchors < (length - 1 if d == 0 else length)) for d in range(depths)]
    lines, ok = compare_steps([o[anchors[c]] for o, c in zip(ours, chosen)], [theirs[c] for c in chosen], args.atol,
                              label="depth")
    embed = target.get_input_embeddings().weight.detach().clone()
    embed[head.config.mask_token_id] = head.mask_embedding.detach()
    state = {k.replace("midlayer.", "layers.0."): v for k, v in head.state_dict().items() if k != "mask_embedding"}
    from draftsmith.heads.formats.parity import compare_tensors
    tensors, same = compare_tensors({**state, "embed_tokens.weight": embed},
                                    {k.removeprefix("state."): v for k, v in out.items() if k.startswith("state.")})
    return tensors[-6:] + lines, same and ok


def _tensors(head, out) -> tuple[list[str], bool]:
    """The head's tensors against the consumer's loaded ones (its layer is ``layers.0`` where ours ``midlayer``)."""
    from draftsmith.heads.formats.parity import compare_tensors

    ours = {k.replace("midlayer.", "layers.0."): v for k, v in head.state_dict().items()}
    lines, ok = compare_tensors(ours, {k.removeprefix("state."): v for k, v in out.items() if k.startswith("state.")})
    return lines[-6:], ok


def _dflash(head, target, config, python, args, target_path) -> tuple[list[str], bool]:
    """Blocks ``[t_a, MASK...]`` at every anchor a of the same target states on both sides: one line per
    block position k >= 1 (the drafts; DSpark: every slot, Markov-corrected, and its confidence), then the causal
    flag as vLLM's update_dflash derives it."""
    import torch

    from draftsmith.heads.formats.parity import compare_steps, run_speculators
    from draftsmith.train.objectives.dflash import DFlashFeatures, block_outputs, sequence_context

    generator = torch.Generator().manual_seed(0)
    bs, length = head.config.block_size, max(args.tokens, head.config.block_size + 2)
    ids = torch.randint(3, target.config.vocab_size, (1, length), generator=generator)
    anchors = torch.arange(1, length - bs)  # the library anchors only where a whole block fits
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        embed = target.get_input_embeddings()
        features = DFlashFeatures(input_ids=ids, loss_mask=torch.ones_like(ids), embeds=embed(ids), targets=None,
                                  hidden=torch.cat([states[i] for i in head.feature_layer_ids], dim=-1),
                                  mask_embed=embed(torch.tensor([head.config.mask_token_id]))[0])
        blocks = block_outputs(head, features, anchors[None], sequence_context(head, features))  # (1, N, bs, H)
        ours = target.get_output_embeddings()(blocks)[0]  # (N, bs, V): the target's lm_head, as the library's
        if head.markov is not None:  # DSpark: slot k's previous token is the data's a+k
            from draftsmith.heads.variants.dspark import corrected
            slots = corrected(head.markov_head, head.confidence_head, blocks[0], ours, ids[0, anchors[:, None] + torch.arange(bs)])
            ours = slots.logits
    inputs = {"hidden_states": features.hidden, "input_ids": ids, "anchors": anchors,
              "position_ids": torch.arange(length)[None]}
    out = run_speculators(python, args.export, str(target_path), inputs)
    theirs = out["blocks"].view(len(anchors), bs, -1)
    first = head.config.first_draft_slot
    lines, ok = compare_steps([ours[:, k] for k in range(first, bs)], [theirs[:, k] for k in range(first, bs)],
                              args.atol, label="block position", first=first)
    if head.markov is not None:
        diff = (slots.confidence - out["confidence"].float()).abs().max().item()
        ok &= diff <= args.atol
        lines.append(f"confidence: max |logit diff| {diff:.3g} {'ok' if diff <= args.atol else 'MISMATCH'}")
    causal = not config.get("sliding_window_non_causal", True)  # vLLM update_dflash: dflash_config.causal
    lines.append(f"vLLM reader: dflash_config.causal={str(causal).lower()} "
                 f"{'MISMATCH (DFlash blocks attend both ways)' if causal else 'ok'}")
    tensors, same = _tensors(head, out)
    return tensors + lines, same and ok and not causal


def cli(argv: list[str] | None = None) -> int:
    """``main`` with user mistakes as one line and exit code 2."""
    return run(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
