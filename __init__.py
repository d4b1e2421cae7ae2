"""draftsmith: train draft models for speculative decoding from a frozen target, and decode with them
losslessly.

The repository's top-level folders are this package's parts (``pyproject.toml`` maps the package to the
repository root): ``draftsmith.data`` < ``draftsmith.heads`` < ``draftsmith.target`` < ``draftsmith.infer`` < ``draftsmith.train``
< ``draftsmith.scripts``, each importing only those before it (docs/design.md). Nothing loads at import.
"""
__version__ = "0.1.0"
