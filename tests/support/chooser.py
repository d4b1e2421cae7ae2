"""Step costs for tests of the draft-length chooser (``infer.drafters.free.chooser``): given, never timed."""
from __future__ import annotations

from draftsmith.infer.cost_model import StepCosts

LENGTHS = (0, 1, 2, 4, 8, 16)
# drafts cost 2% of a verify per level, a verify 10% more per token: a new row (prior acceptance 0.6) drafts 3,
# a row whose drafts keep missing goes down to 0 and probes
CHEAP = StepCosts(LENGTHS, tuple(0.02 * k for k in LENGTHS), tuple(1 + 0.1 * k for k in LENGTHS), (0.0,) * 6)
# the same cheap drafts, a flat verify (a GPU's t(N)) and a verify costing one token's forward per token
FLAT = StepCosts(LENGTHS, tuple(0.01 * k for k in LENGTHS), (1.0,) * 6, (0.0,) * 6)
STEEP = StepCosts(LENGTHS, tuple(0.01 * k for k in LENGTHS), tuple(1.0 + k for k in LENGTHS), (0.0,) * 6)


def tiny_eagle3():
    """(a tiny Llama without EOS, a random EAGLE-3 head of it): the chooser tests' decoder."""
    import torch
    from support.targets import make_tiny_target

    from draftsmith.heads import build_head

    target = make_tiny_target("llama", dtype=torch.float32)
    target.generation_config.eos_token_id = None
    torch.manual_seed(0)
    return target, build_head("eagle3", target)

