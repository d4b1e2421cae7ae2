"""Variants of the head kinds: each a subclass of its kind's config and head (``heads.auto.VARIANT_CLASSES`` registers
them beside the kinds, as (kind, variant) -> head class): P-EAGLE on EAGLE-3, DSpark and Domino on DFlash."""
