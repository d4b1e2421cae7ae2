"""An export's drafts against the head's own, both run on the same target states: the export by its consumer's
code (speculators, ``heads.formats.parity``), the head by the training passes that define its drafts (training-time
test for EAGLE-3, the parallel depths for P-EAGLE, the blocks for DFlash and DSpark). ``draftsmith check-export``
prints the lines; ``options`` are its settings (``export``, ``steps``, ``tokens``, ``atol``)."""
from __future__ import annotations


def consumer_parity(head, target, config: dict, python, options, target_path) -> tuple[list[str], bool]:
    """One line per compared step (block position, depth) and for the tensors; True when all agree."""
    run = _dflash if head.head_kind == "dflash" else _peagle if getattr(head.config, "is_peagle", False) else _eagle3
    return run(head, target, config, python, options, target_path)


def _eagle3(head, target, config, python, options, target_path) -> tuple[list[str], bool]:
    """Both sides on the same target states: ``(1, T)`` tokens, their aux features ``(1, T, 3·H_t)``."""
    import torch

    from draftsmith.heads.formats.parity import compare_steps, run_speculators
    from draftsmith.train.unroll import shift_left, unroll

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (1, options.tokens), generator=generator)
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.feature_layer_ids], dim=-1)
        embeds = target.get_input_embeddings()(ids)
        ours = [head.compute_logits(h)[0] for h in unroll(head, head.project(aux), embeds, options.steps)]
    # the library's step k reads input_ids shifted by k: ours reads token i+1+k, so it gets ids shifted by one
    inputs = {"hidden_states": aux, "input_ids": shift_left(ids, 1), "steps": torch.tensor(options.steps),
              "position_ids": torch.arange(options.tokens)[None]}
    out = run_speculators(python, options.export, str(target_path), inputs)
    theirs = [out[f"step{k}"][0] for k in range(options.steps) if f"step{k}" in out]
    keep = options.tokens - options.steps  # the last positions read the padding each side fills its own way
    tensors, same = _tensors(head, out)
    lines, ok = compare_steps([o[:keep] for o in ours], [t[:keep] for t in theirs], options.atol)
    return tensors + lines, same and ok


def _peagle(head, target, config, python, options, target_path) -> tuple[list[str], bool]:
    """P-EAGLE: every depth d at every anchor of the same target states on both sides (the library's COD sampling
    told to keep them all), one line per depth; the tensors, the mask embedding as the export's embed_tokens row."""
    import torch

    from draftsmith.heads.formats.parity import compare_steps, run_speculators
    from draftsmith.train.objectives.variants.peagle import all_rollouts, parallel_outputs
    from draftsmith.train.unroll import shift_left

    depths, length = head.config.num_depths, options.tokens
    ids = torch.randint(3, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.feature_layer_ids], dim=-1)
        outs = parallel_outputs(head, aux, target.get_input_embeddings()(ids), all_rollouts(ids, depths))
        ours = [head.compute_logits(out)[0] for out in outs]  # depth d: (T, Vd), anchor a at row a
    inputs = {"hidden_states": aux, "input_ids": shift_left(ids, 1), "steps": torch.tensor(depths)}
    out = run_speculators(python, options.export, str(target_path), inputs)
    anchors, drawn, theirs = out["anchors"], out["depth"], out["depths"][0]
    # each element of the library's at an anchor inside the row; depth 0's last reads the padding each side fills its
    # own way (the library's input_ids shifted left end in token 0, ours in a zero embedding)
    chosen = [(drawn == d) & (anchors >= 0) & (anchors < (length - 1 if d == 0 else length)) for d in range(depths)]
    lines, ok = compare_steps([o[anchors[c]] for o, c in zip(ours, chosen)], [theirs[c] for c in chosen], options.atol,
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


def _dflash(head, target, config, python, options, target_path) -> tuple[list[str], bool]:
    """Blocks ``[t_a, MASK...]`` at every anchor a of the same target states on both sides: one line per
    block position k >= 1 (the drafts; DSpark: every slot, Markov-corrected, and its confidence), then the causal
    flag as vLLM's update_dflash derives it."""
    import torch

    from draftsmith.heads.formats.parity import compare_steps, run_speculators
    from draftsmith.train.objectives.dflash import DFlashFeatures, block_outputs, sequence_context

    generator = torch.Generator().manual_seed(0)
    bs, length = head.config.block_size, max(options.tokens, head.config.block_size + 2)
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
    out = run_speculators(python, options.export, str(target_path), inputs)
    theirs = out["blocks"].view(len(anchors), bs, -1)
    first = head.config.first_draft_slot
    lines, ok = compare_steps([ours[:, k] for k in range(first, bs)], [theirs[:, k] for k in range(first, bs)],
                              options.atol, label="block position", first=first)
    if head.markov is not None:
        diff = (slots.confidence - out["confidence"].float()).abs().max().item()
        ok &= diff <= options.atol
        lines.append(f"confidence: max |logit diff| {diff:.3g} {'ok' if diff <= options.atol else 'MISMATCH'}")
    causal = not config.get("sliding_window_non_causal", True)  # vLLM update_dflash: dflash_config.causal
    lines.append(f"vLLM reader: dflash_config.causal={str(causal).lower()} "
                 f"{'MISMATCH (DFlash blocks attend both ways)' if causal else 'ok'}")
    tensors, same = _tensors(head, out)
    return tensors + lines, same and ok and not causal
