"""Host syncs per decode step, counted: greedy decoding with a head reads the device once per step
(every row's accepted length and EOS flag together), whatever the batch size and whether EOS is set;
with an EAGLE-2 dynamic tree twice (every row's selected nodes together, then acceptance).

On a CPU nothing waits, so the count is of the calls that would wait for a GPU: reading a tensor's
values on the host (``item``, ``tolist``, ``bool``/``int``/``float``/index conversions, ``cpu``,
``numpy``) and ``nonzero`` (its output size depends on the values). Host-to-device copies of host
ints are not counted. The count per step is the difference between two generations that differ
only in their number of steps, so setup and the prefill cancel out.
"""
from __future__ import annotations

import random

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith.heads import build_head
from draftsmith.infer import Chain, DynamicTree, SpeculativeGenerator, StaticTree
from draftsmith.infer import batch_accept

VOCAB = 96
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


def _count_reads(monkeypatch) -> list[int]:
    """Patch every host read of torch.Tensor to count its calls; returns the (mutable) counter."""
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return count


def test_the_counter_sees_host_reads(monkeypatch):
    count = _count_reads(monkeypatch)
    x = torch.arange(4)
    int(x[1]), x.tolist(), bool(x.any()), x.nonzero(), x[:2].cpu()
    assert count[0] == 5


HEADS = {
    "eagle-chain": ("eagle", Chain(3), {}),
    "eagle3-chain": ("eagle3", Chain(4), {}),
    "dflash": ("dflash", Chain(3), {"block_size": 4}),
    "medusa-chain": ("medusa", Chain(3), {}),
    "medusa-tree": ("medusa", StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0))), {}),
    "eagle-dynamic": ("eagle", DynamicTree(depth=3, top_k=2, total_tokens=6), {}),
    "eagle3-dynamic": ("eagle3", DynamicTree(depth=2, top_k=3, total_tokens=5), {}),
}
READS_PER_STEP = {"eagle-dynamic": 2, "eagle3-dynamic": 2}  # + the tree's selection, one for every row


# Eager: every head, one row and four. Compiled drafting (a trace each, about 15x an eager case here): each
# compiled draft function once, one with one row and two with four (a trace's host reads are its function's and
# the shared verify's; its batch size changes no read): EagleDrafter's chain ``_fixed_levels`` (eagle3-chain; an
# EAGLE-1 chain runs the same function, differing only in ``_logits``/``_to_target``/``_project``, which the eager
# eagle-chain cases run too: its traced case was dropped in round 3), its dynamic tree ``_tree_levels``, DFlash's
# block pass.
@pytest.mark.parametrize("name,compile,bsz", [(name, False, bsz) for name in sorted(HEADS) for bsz in (1, 4)]
                         + [("eagle3-chain", "aot_eager", 4), ("dflash", "aot_eager", 1),
                            ("eagle-dynamic", "aot_eager", 4)])
def test_greedy_steps_read_the_host_once(monkeypatch, name, compile, bsz):
    model = make_tiny_target("llama", dtype=torch.float32, initializer_range=0.3)
    kind, tree, kw = HEADS[name]
    torch.manual_seed(0)
    gen = SpeculativeGenerator(model, build_head(kind, model, **kw), tree=tree, compile=compile)
    rng = random.Random(bsz)
    prompts = [[rng.randrange(3, VOCAB - 1) for _ in range(n)] for n in (5, 9, 3, 7)[:bsz]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    emitted = set(gen.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])[:, width:].flatten().tolist())
    eos = min(set(range(3, VOCAB)) - emitted)  # EOS set, to a token these rows never emit: its check runs every step
    count = _count_reads(monkeypatch)
    reads, steps = [], []
    for max_new in (6, 20):
        count[0] = 0
        gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos)
        reads.append(count[0])
        steps.append(gen.last_stats.steps)
    assert steps[1] > steps[0]
    assert reads[1] - reads[0] == READS_PER_STEP.get(name, 1) * (steps[1] - steps[0]), (reads, steps)


@pytest.mark.parametrize("name", ["eagle3-chain", "eagle-dynamic", "medusa-tree"])
@pytest.mark.parametrize("bsz", [1, 4])
def test_sampling_steps_read_the_host_once_besides_each_rows_acceptance(monkeypatch, name, bsz):
    """Sampling: each row's rejection sampling reads the host as it goes (counted apart here); every
    other read of the step (every row's accepted length and EOS, a dynamic tree's selection) is
    shared by the rows."""
    model = make_tiny_target("llama", dtype=torch.float32, initializer_range=0.3)
    kind, tree, kw = HEADS[name]
    torch.manual_seed(0)
    gen = SpeculativeGenerator(model, build_head(kind, model, **kw), tree=tree)
    rng = random.Random(bsz)
    prompts = [[rng.randrange(3, VOCAB - 1) for _ in range(n)] for n in (5, 9, 3, 7)[:bsz]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    count = _count_reads(monkeypatch)
    inside = [0]
    accept = batch_accept.sample_accept

    def counted_apart(*args, **kwargs):
        start = count[0]
        out = accept(*args, **kwargs)
        inside[0] += count[0] - start
        return out

    monkeypatch.setattr(batch_accept, "sample_accept", counted_apart)
    reads, steps = [], []
    for max_new in (6, 20):
        count[0] = inside[0] = 0
        torch.manual_seed(1)
        gen.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=VOCAB - 1, temperature=0.8, top_k=0)
        reads.append(count[0] - inside[0])
        steps.append(gen.last_stats.steps)
    assert steps[1] > steps[0]
    assert reads[1] - reads[0] == READS_PER_STEP.get(name, 1) * (steps[1] - steps[0]), (reads, steps)
