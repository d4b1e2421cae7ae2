"""Drafters that are no head kind and need no training: ``ngram`` (prompt lookup), ``lookup_first`` (prompt
lookup, else another drafter), ``lm_drafter`` (a small LM), ``layer_skip`` (the target's first layers),
``hierarchical`` (a draft LM whose own drafts are guessed) and ``adaptive`` (a chain whose length follows the
acceptance, over any drafter). Import them from their modules."""
