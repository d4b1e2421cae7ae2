"""Entry points: thin front-ends over the library (each also runs as ``python scripts/NAME.py``)."""
