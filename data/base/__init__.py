"""The bottom floor: what every folder may use and that imports nothing of ours.

- ``data.base.paths``: the cache root and readable files;
- ``data.base.names``: how targets are named (``demo:`` names, Hub ids, local paths);
- ``data.base.device``: the default device and the one host-device sync;
- ``data.base.checks``: values checked where they enter (counts, probabilities);
- ``data.base.progress``: progress bars on a terminal, periodic lines in a log file.

``data.entry_point`` (one-line errors for entry points) also imports nothing of ours.
"""
