"""An oracle drafter: it drafts a known continuation, so timing runs know their acceptance."""
from __future__ import annotations

import torch

from draftsmith.infer.drafters import Draft, Drafter, Sampling
from draftsmith.infer.tree import chain_parents, tree_from_parents


class OracleDrafter(Drafter):
    """Drafts ``sequence`` (the expected output, prompt included) from the current position: a
    chain of ``depth`` tokens, or with ``tree_nodes`` that chain plus decoy children (tokens the
    sequence does not continue with) spread over the root and the chain nodes, ``tree_nodes`` in
    all. A wrong guess (the generator left the sequence) is simply rejected."""

    aux_layer_ids = ()

    def __init__(self, sequence: torch.Tensor, prompt_len: int, depth: int, vocab_size: int,
                 tree_nodes: int | None = None) -> None:
        self.seq, self.depth, self.vocab_size = sequence, depth, vocab_size
        self.prompt_len = prompt_len
        self.max_nodes = tree_nodes or depth + 1
        self._trees: dict[int, tuple] = {}

    def new_rows(self, prompts: list[torch.Tensor], lengths: list[int]) -> list[dict]:
        return [{"pos": self.prompt_len} for _ in prompts]  # index of the root (the first new token) in seq

    def observe_rows(self, states: list[dict], features: list[torch.Tensor], next_tokens: list[torch.Tensor]) -> None:
        for state, feats, tokens in zip(states, features, next_tokens):
            if feats.shape[1] != tokens.shape[1] or feats.shape[1] == 0:
                raise AssertionError("the generator must pass one feature per accepted token")
            state["pos"] += tokens.shape[1] if state.get("started") else 0
            state["started"] = True

    def _layout(self, levels: int, device: torch.device):
        """Parents and, per node, (depth, is_path) of the tree for ``levels`` draft levels."""
        if levels not in self._trees:
            if self.max_nodes == self.depth + 1 or levels == 0:
                parents = chain_parents(levels)
                on_path = [True] * (levels + 1)
                depths = list(range(levels + 1))
            else:
                decoys = self.max_nodes - 1 - levels
                per_parent = [decoys // (levels + 1) + (i < decoys % (levels + 1)) for i in range(levels + 1)]
                parents, on_path, depths, path = [-1], [True], [0], [0]
                for d in range(1, levels + 2):  # level d: the path node (d <= levels) and decoys of path[d-1]
                    if d <= levels:
                        parents.append(path[d - 1]); on_path.append(True); depths.append(d)
                        path.append(len(parents) - 1)
                    for _ in range(per_parent[d - 1]):
                        parents.append(path[d - 1]); on_path.append(False); depths.append(d)
            buffers = tree_from_parents(parents, device)
            self._trees[levels] = (buffers, torch.tensor(on_path, device=device), torch.tensor(depths, device=device))
        return self._trees[levels]

    def propose_rows(self, states: list[dict], roots: list[torch.Tensor], sampling: Sampling,
                     max_depths: list[int]) -> list[Draft]:
        return [self._propose(s["pos"], r, d) for s, r, d in zip(states, roots, max_depths)]

    def _propose(self, pos: int, root: torch.Tensor, max_depth: int) -> Draft:
        """The row's draft from seq[pos] on (its root) to ``max_depth`` levels."""
        levels = max(0, min(self.depth, max_depth, self.seq.numel() - pos - 1))
        buffers, on_path, depths = self._layout(levels, root.device)
        truth = self.seq[pos + depths.clamp(max=self.seq.numel() - pos - 1)]  # (N,) true token at each depth
        # 1 + i < vocab: a decoy never equals the true token at its depth
        decoy = (truth + 1 + torch.arange(truth.numel(), device=root.device)) % self.vocab_size
        tokens = torch.where(on_path, truth, decoy)
        tokens[0] = root
        return Draft(tokens, buffers)
