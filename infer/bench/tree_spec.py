"""The tree names ``scripts/benchmark.py --trees`` takes; ``infer.bench.methods.tree_from_spec`` builds them.

Apart from the builder (which loads torch) so that a bad name is refused before torch loads."""
from __future__ import annotations

import re

# default | tree | chainN | dynD-K-N (depth, top-k, nodes) | medusaN
TREE_SPEC = re.compile(r"^(tree|default|chain(\d+)|dyn(\d+)-(\d+)-(\d+)|medusa(\d+))$")
