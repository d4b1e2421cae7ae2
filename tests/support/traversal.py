"""A toy language for the tree rules' statistical tests: the target's and the draft's laws depend on the whole
prefix (tables over a 5-token vocabulary), draft trees of a fixed shape are drawn from the draft law (each node's
children without replacement, in order) or hold fixed tokens, and the emitted tokens of many trials are checked
against the target's law at every prefix (chi-square, fixed seeds). No tests here."""
from __future__ import annotations

import torch
from support.accept import chi_square_pvalue

from draftsmith.infer.drafters import Draft, Drafter
from draftsmith.infer.drafters.base import root_only
from draftsmith.infer.tree import tree_from_parents

VOCAB = 5
DEPTH = 4  # laws for prefixes of up to DEPTH tokens (a depth-3 tree's bonus reads depth 3)

# The tests' tree shapes (parent lists, nodes in depth order)
SHAPES = {
    "chain": [-1, 0, 1, 2],
    "wide-root": [-1, 0, 0, 0, 0],
    "two-level": [-1, 0, 0, 0, 1, 1, 2, 2, 4],  # siblings under siblings, one node three deep
}


def toy_laws(seed: int, scale: float) -> list[torch.Tensor]:
    """Per prefix length k a table (V**k, V) of laws over the next token: logits * ``scale``, softmax."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(VOCAB ** k, VOCAB, generator=gen) * scale).softmax(-1) for k in range(DEPTH + 1)]


def draw_trees(parents: list[int], laws: list[torch.Tensor], trials: int, sampled: bool,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, N), prefix ids (B, N)): each node's token and the id of the prefix ending at it (its depth
    gives the table). Each node's children are drawn without replacement from its law, in node order
    (``sampled``), or are its law's most likely tokens, best first (fixed drafts, as EAGLE's top-k)."""
    gen = torch.Generator().manual_seed(seed)
    tree = tree_from_parents(parents)
    n, kids = len(parents), tree.children.tolist()
    tokens = torch.zeros(trials, n, dtype=torch.long)
    ids = torch.zeros(trials, n, dtype=torch.long)
    depths = tree.depths.tolist()
    for node in range(n):
        children = [c for c in kids[node] if c >= 0]
        if not children:
            continue
        if not sampled:
            drawn = laws[depths[node]][ids[:, node]].argsort(dim=1, descending=True, stable=True)[:, : len(children)]
        else:
            drawn = torch.multinomial(laws[depths[node]][ids[:, node]], len(children), replacement=False, generator=gen)
        for j, c in enumerate(children):
            tokens[:, c] = drawn[:, j]
            ids[:, c] = ids[:, node] * VOCAB + drawn[:, j]
    return tokens, ids


def node_laws(laws: list[torch.Tensor], parents: list[int], ids: torch.Tensor) -> torch.Tensor:
    """(B, N, V) each node's law (target or draft) at its prefix."""
    depths = tree_from_parents(parents).depths.tolist()
    return torch.stack([laws[depths[i]][ids[:, i]] for i in range(len(parents))], dim=1)


def emitted(out, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per position k the emitted token (B,) (accepted drafts, then the bonus), -1 past the step's end."""
    width = out.nodes.shape[1]
    drafted = tokens.gather(1, out.nodes[:, 1:].clamp(min=0))  # (B, width - 1)
    seq = torch.cat([drafted, torch.zeros_like(drafted[:, :1])], dim=1)
    seq.scatter_(1, (out.length - 1)[:, None], out.bonus[:, None])
    pos = torch.arange(width)[None]
    seq = torch.where(pos < out.length[:, None], seq, -1)
    return list(seq.unbind(1))


def prefix_pvalue(target: list[torch.Tensor], seq: list[torch.Tensor], min_count: int = 300) -> tuple[float, int]:
    """Smallest chi-square p-value, over every prefix s emitted at least ``min_count`` times with a token after it,
    of the token after s against the target's law at s; and how many prefixes were tested."""
    pvalues = []
    prefix = torch.zeros_like(seq[0])
    alive = torch.ones_like(seq[0], dtype=torch.bool)
    for k, tok in enumerate(seq[: DEPTH]):
        alive = alive & (tok >= 0)
        for s in torch.unique(prefix[alive]).tolist():
            sel = alive & (prefix == s)
            if int(sel.sum()) >= min_count:
                pvalues.append(chi_square_pvalue(torch.bincount(tok[sel], minlength=VOCAB), target[k][s]))
        prefix = prefix * VOCAB + tok.clamp(min=0)
    return min(pvalues), len(pvalues)


def mean_accepted(out) -> float:
    """Mean emitted tokens per trial (accepted drafts + the bonus): the step's τ."""
    return float(out.length.float().mean())


class SampledOracleDrafter(Drafter):
    """A drafter for end-to-end tests (``infer.drafters.Drafter``'s verbs): a static two-level tree whose children
    are drawn without replacement from a law near the target's own (``mix`` of it, the rest uniform; the target's
    looked up for the contexts the law test reads); at temperature 0 the law's most likely tokens. Its laws travel
    with the draft (``Draft.q``), so deep nodes are often accepted and every rule's residual path is exercised."""

    aux_layer_ids = ()
    PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # root: 2 children; the first has 2, the second 1; the first grandchild 1
    max_nodes = len(PARENTS)

    def __init__(self, target, prompt: list[int], mix: float = 0.7) -> None:
        """The target's logits after ``prompt`` plus every continuation of up to 3 tokens, in 4 batched forwards
        (a lookup; other contexts draft from the uniform law)."""
        import itertools

        vocab = target.config.vocab_size
        self.mix, self.logits = mix, {}
        with torch.no_grad():
            for k in range(4):
                tails = list(itertools.product(range(vocab), repeat=k))
                ids = torch.tensor([prompt + list(s) for s in tails])
                self.logits.update(zip((tuple(prompt) + s for s in tails), target(ids).logits[:, -1]))
        self.uniform = torch.zeros(vocab)

    def new_rows(self, prompts, lengths):
        return [[prompt[0, :1]] for prompt in prompts]  # observe_rows appends the rest

    def observe_rows(self, states, features, next_tokens):
        for state, tokens in zip(states, next_tokens):
            state[0] = torch.cat([state[0], tokens[0]])

    def propose_rows(self, states, roots, sampling, max_depths):
        return [self._propose(state[0], root, depth, sampling) for state, root, depth in zip(states, roots, max_depths)]

    def _propose(self, seq, root, max_depth: int, sampling):
        tree = tree_from_parents(self.PARENTS)
        keep = [i for i, d in enumerate(tree.depths.tolist()) if d <= max_depth]
        if len(keep) == 1:
            return root_only(root)
        parents = self.PARENTS[: len(keep)]  # nodes are in depth order: a cut keeps a prefix
        tokens, laws, contexts = [int(root)], {}, {0: seq}
        for node in range(1, len(keep)):
            up = parents[node]
            if up not in laws:
                logits = self.logits.get(tuple(contexts[up].tolist()), self.uniform)
                p = sampling.probs(logits) if not sampling.greedy else logits.softmax(-1)
                law = self.mix * p + (1 - self.mix) / p.shape[-1]
                count = parents.count(up)
                drawn = law.argsort(descending=True)[:count] if sampling.greedy else torch.multinomial(law, count)
                laws[up] = (law, drawn.tolist())
            tokens.append(laws[up][1][parents[:node].count(up)])
            contexts[node] = torch.cat([contexts[up], torch.tensor([tokens[-1]])])
        q = None if sampling.greedy else torch.stack([laws[parents[i]][0] for i in range(1, len(keep))])
        return Draft(torch.tensor(tokens), tree_from_parents(parents), q)
