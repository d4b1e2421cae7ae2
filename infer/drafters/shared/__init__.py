"""Pieces the kinds' drafters share that are neither a kind nor a drafter: an EAGLE head's static trees
(``static_tree``)."""
