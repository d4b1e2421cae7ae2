"""The mask token a parallel drafter embeds at the positions it has not seen (DFlash, DSpark, Domino, P-EAGLE):
an existing, ordinary row of the target's embedding, refused in one line otherwise (``check_mask_token``)."""
from __future__ import annotations


def check_mask_token(mask_id: int, target, tokenizer=None) -> None:
    """Refuse (ValueError, one line naming the id) a mask token that is not an existing, ordinary row of the
    target's embedding: outside it, past the tokenizer's ids (an untrained padding row), or an alias of the
    pad, EOS or BOS token (whose embedding already means something; NeMo Automodel#2461, ModelOpt#1621).
    ``target``: the model, or its config (its ``vocab_size`` rows). Training checks it (``prepare_head``), and so
    does every load beside a target (``check_target`` of DFlash's and P-EAGLE's heads)."""
    embeddings = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    rows = embeddings.weight.shape[0] if embeddings is not None else target.vocab_size
    if not 0 <= mask_id < rows:
        raise ValueError(f"head.mask_token_id={mask_id} is not a row of the target's embedding (0..{rows - 1})")
    if tokenizer is not None and mask_id >= len(tokenizer):
        raise ValueError(f"head.mask_token_id={mask_id} is past the tokenizer's {len(tokenizer)} ids: an untrained "
                         "padding row of the embedding; pick an id the target was trained on")
    special: dict[int, str] = {}
    sources = [getattr(target, "config", target), getattr(target, "generation_config", None), tokenizer]
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        for source in sources:
            ids = getattr(source, name, None) if source is not None else None
            for i in ids if isinstance(ids, (list, tuple)) else [ids]:
                if isinstance(i, int):
                    special.setdefault(i, name.removesuffix("_id"))
    if mask_id in special:
        raise ValueError(f"head.mask_token_id={mask_id} is the target's {special[mask_id]}: the mask must not alias "
                         "pad/EOS/BOS; set head.mask_token_id to a reserved or rare ordinary token")
