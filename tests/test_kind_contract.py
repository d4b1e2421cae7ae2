"""Every head kind keeps the contract a kind is made of (heads.HEAD_CLASSES is the one list of kinds):
its training objective and its drafter take what their bases declare, the config takes its keys, its
card renders, one training step runs on the target online and on stored states alike, and it exports
to every format that lists it."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from conftest import make_tiny_target

from heads import HEAD_CLASSES, build_head
from heads.card import model_card
from heads.formats import FORMATS, export_head, validate_export
from infer.drafters import drafter_class
from infer.drafters.base import HeadDrafter
from infer.target import TargetOutput, target_forward
from train.config import load_config
from train.objectives import Objective, objective_class

KINDS = tuple(HEAD_CLASSES)
SMALL = {"dflash": ["head.block_size=4", "head.num_layers=1"]}  # a fast CPU shape; other kinds: their defaults
# every kind, and the variants a kind declares (the kind's own name, then its head.* keys)
CASES = {**{kind: (kind, SMALL.get(kind, [])) for kind in KINDS},
         "dflash2": ("dflash", [*SMALL["dflash"], "head.variant=dflash2", "head.selector_rank=8", "head.selector_top_k=4"])}
REFUSED = {"dflash2": {"speculators": "carries no DFlash2"}}  # formats a variant's kind lists that cannot carry it


def _members(base: type) -> list[str]:
    """The methods ``base`` declares for its kinds to keep (``__init__`` and every public one)."""
    return sorted(name for name in dir(base) if (name == "__init__" or not name.startswith("_"))
                  and callable(getattr(base, name)) and any(name in vars(c) for c in base.__mro__[:-1]))


def drift(base: type, cls: type) -> list[str]:
    """How ``cls``'s methods differ from ``base``'s: each must take the same parameters, in order, of
    the same kind, keeping every default the base gives (a kind may add a default, not drop one)."""
    found = []
    for name in _members(base):
        want = list(inspect.signature(getattr(base, name)).parameters.values())
        have = list(inspect.signature(getattr(cls, name)).parameters.values())
        same = len(want) == len(have) and all(
            w.name == h.name and w.kind == h.kind and (w.default is inspect.Parameter.empty or w.default == h.default)
            for w, h in zip(want, have))
        if not same:
            found.append(f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} != "
                         f"{base.__name__}.{name}{inspect.signature(getattr(base, name))}")
    return found


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", num_layers=6)


@pytest.mark.parametrize("kind", KINDS)
def test_objective_and_drafter_keep_their_bases_signatures(kind):
    assert drift(Objective, objective_class(kind)) == []
    assert drift(HeadDrafter, drafter_class(kind)) == []


def test_drift_finds_a_changed_signature():
    """The check above can fail: a features() without ``states`` (what early-exit's once was) and a
    propose() with a renamed parameter are found."""
    class NoStates(Objective):
        @staticmethod
        def features(target, batch, head, need_top1=False):
            raise NotImplementedError

    class Renamed(HeadDrafter):
        def propose(self, state, token, sampling, max_depth):
            raise NotImplementedError

    assert [line.split("(")[0] for line in drift(Objective, NoStates)] == ["NoStates.features"]
    assert [line.split("(")[0] for line in drift(HeadDrafter, Renamed)] == ["Renamed.propose"]


@pytest.mark.parametrize("case", CASES)
def test_a_kind_trains_a_step_online_and_from_stored_states(case, target):
    kind, small = CASES[case]
    cfg = load_config(None, [f"head.kind={kind}", *small])
    for key in ("data.features=stored", "data.feature_cache=cache"):  # both accepted at parse time
        assert load_config(None, [f"head.kind={kind}", key]).head.kind == kind
    torch.manual_seed(0)
    head = build_head(kind, target, **cfg.head.build_options())
    objective, cls = objective_class(kind)(head, cfg), objective_class(kind)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    online = cls.features(target, batch, head, need_top1=True)
    states = target_forward(target, ids, aux_layer_ids=cls.aux_layer_ids(head), compute_logits=False)
    stored = cls.features(target, batch, head, need_top1=True,  # as data.features hands them: no logits
                          states=TargetOutput(None, states.final_hidden, states.aux_hidden, None))
    assert type(online) is type(stored)
    for field in dataclasses.fields(online):
        a, b = getattr(online, field.name), getattr(stored, field.name)
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, msg=f"{kind}: {field.name}")
        else:
            assert (a is None) == (b is None), field.name

    before = [p.detach().clone() for p in head.parameters()]
    optimizer = torch.optim.AdamW(objective.param_groups(), lr=1e-2)
    objective.train()
    objective.perturb(stored, cfg, seed=0)
    out = objective(stored, target.get_output_embeddings())
    assert torch.isfinite(out.loss) and out.count.sum() > 0, kind
    out.loss.backward()
    optimizer.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, head.parameters())), f"{kind}: no weight moved"


@pytest.mark.parametrize("case", CASES)
def test_a_kind_renders_its_card_and_exports_to_its_formats(case, target, tmp_path):
    kind, small = CASES[case]
    head = build_head(kind, target, **load_config(None, [f"head.kind={kind}", *small]).head.build_options())
    head.config.target_name_or_path = "example/tiny-llama"  # a Hub id: TGI's export names its base model
    card = model_card(head)
    assert head.title and f"# {head.title} draft head" in card
    assert all(line in card for line in head.card_input_lines(None))
    formats = [fmt for fmt, spec in FORMATS.items() if kind in spec.kinds]
    for fmt in formats:
        if fmt in REFUSED.get(case, {}):
            with pytest.raises(ValueError, match=REFUSED[case][fmt]):
                export_head(head, tmp_path / fmt, fmt, target=target)
            continue
        out = export_head(head, tmp_path / fmt, fmt, target=target)
        validate_export(out, fmt)
        assert head.title in (out / "README.md").read_text()
