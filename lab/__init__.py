"""Our own measurement harnesses (the GPU lease, the real-model report, the rollback, feature and pipeline benches,
the acceptance curve): run from a clone as ``python lab/NAME.py``. The wheel does not install this folder
(pyproject's packages leave it out); it is the top of the house and may import every library folder and
``scripts/``."""
