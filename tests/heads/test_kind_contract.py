"""Every head kind keeps the contract a kind is made of (heads.HEAD_CLASSES is the one list of kinds):
its training objective and its drafter take what their bases declare, the config takes its keys (and
asks the objective which settings it reads and what it fills: ``Objective.reads``, ``configure``), its
card renders, one training step runs on the target online and on stored states alike, and it exports
to every format that lists it. Every drafter class (heads' and the rest) keeps ``Drafter``'s batched
interface: its verbs take a batch's rows, and it has no public verb of its own (no single-row twin)."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing

import pytest
import torch
from support.targets import make_tiny_target

from draftsmith import infer
from draftsmith.heads import HEAD_CLASSES, build_head, variants as head_variants
from draftsmith.heads.common import DraftHead
from draftsmith.heads.kinds import VARIANT_CLASSES, head_class, kind_variants
from draftsmith.heads.card import model_card
from draftsmith.heads.formats import FORMATS, export_head, validate_export
from draftsmith.infer.drafters import drafter_class, variants as drafter_variants
from draftsmith.infer.drafters.base import Drafter, HeadDrafter
from draftsmith.target.model import TargetOutput, target_forward
from draftsmith.heads.auto import config_options
from draftsmith.train.config import ConfigError, load_config
from draftsmith.train.objectives import Objective, objective_class, variants as objective_variants
from draftsmith.train.settings import TrainConfig
from support.house import REPO

KINDS = tuple(HEAD_CLASSES)
SMALL = {"dflash": ["head.block_size=4", "head.num_layers=1"]}  # a fast CPU shape; other kinds: their defaults
# every kind, and the variants a kind declares (the kind's own name, then its head.* keys)
CASES = {**{kind: (kind, SMALL.get(kind, [])) for kind in KINDS},
         "dflash2": ("dflash", [*SMALL["dflash"], "head.variant=dflash2", "head.selector_rank=8", "head.selector_top_k=4"]),
         "dspark": ("dflash", [*SMALL["dflash"], "head.variant=dspark", "head.markov_rank=8"]),
         "domino": ("dflash", [*SMALL["dflash"], "head.variant=domino", "head.gru_hidden_dim=8", "head.emb_dim=8"]),
         "peagle": ("eagle3", ["head.variant=peagle", "head.num_depths=3"])}
# formats a kind or variant's kind lists that cannot carry it
REFUSED = {"dflash": {"dspark": "carries DSpark heads"},
           "dflash2": {"speculators": "carries no DFlash2", "dspark": "carries DSpark heads"},
           "dspark": {"dflash": "carries no DSpark"},
           "domino": {"speculators": "carries no Domino", "dspark": "carries DSpark heads"},
           "peagle": {"vllm": "carries no P-EAGLE", "sglang": "carries no P-EAGLE"}}


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


def drafter_classes() -> list[type]:
    """Every drafter class ``infer/`` defines: each of its modules imported, then ``Drafter``'s subclasses
    (``HeadDrafter``, a base itself, left out)."""
    for module in pkgutil.walk_packages(infer.__path__, "draftsmith.infer."):
        importlib.import_module(module.name)
    found, todo = set(), [Drafter]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("draftsmith.infer.") and sub is not HeadDrafter:
                found.add(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__name__}")


VERBS = ("new_rows", "observe_rows", "propose_rows")  # what a drafter must implement; the hooks are optional


def contract_faults(cls: type) -> list[str]:
    """How ``cls`` breaks ``Drafter``'s interface: a verb it leaves to the base (which only raises), a
    public method whose signature drifts from its base's, or a public method no base declares (such as a
    single-row ``propose`` beside ``propose_rows``)."""
    base = HeadDrafter if issubclass(cls, HeadDrafter) else Drafter
    faults = [f"{cls.__name__}.{verb} not implemented" for verb in VERBS if getattr(cls, verb) is getattr(Drafter, verb)]
    faults += drift(base, cls)
    faults += [f"{cls.__name__}.{name} is public but no base declares it" for name in dir(cls)
               if not name.startswith("_") and callable(getattr(cls, name)) and not hasattr(base, name)]
    return faults


@pytest.mark.parametrize("cls", drafter_classes(), ids=lambda c: c.__name__)
def test_every_drafter_keeps_the_batched_interface(cls):
    assert contract_faults(cls) == []


def test_every_drafter_is_found():
    """The walk finds the drafters beside the heads' too (a walk that found none would pass above)."""
    names = {c.__name__ for c in drafter_classes()}
    assert {"NgramDrafter", "LookupFirst", "HierarchicalDrafter", "LMDrafter", "AdaptiveLength", "OracleDrafter"} <= names
    assert {drafter_class(kind).__name__ for kind in KINDS} <= names


def test_contract_finds_a_drifted_drafter():
    """The check can fail: a ``propose_rows`` taking one row's arguments, a single-row ``propose`` left
    beside the batched verbs, and a drafter that never implements ``observe_rows`` are each found."""
    class OneRow(Drafter):
        def new_rows(self, prompts, lengths):
            return []

        def observe_rows(self, states, features, next_tokens):
            pass

        def propose_rows(self, state, root, sampling, max_depth):
            raise NotImplementedError

    class Leftover(OneRow):
        def propose_rows(self, states, roots, sampling, max_depths):
            return [self.propose(s, r, sampling, d) for s, r, d in zip(states, roots, max_depths)]

        def propose(self, state, root, sampling, max_depth):
            raise NotImplementedError

    class Unobserving(Drafter):
        def new_rows(self, prompts, lengths):
            return []

        def propose_rows(self, states, roots, sampling, max_depths):
            return []

    assert [f.split("(")[0] for f in contract_faults(OneRow)] == ["OneRow.propose_rows"]
    assert contract_faults(Leftover) == ["Leftover.propose is public but no base declares it"]
    assert contract_faults(Unobserving) == ["Unobserving.observe_rows not implemented"]


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", num_layers=6)


@pytest.mark.parametrize("kind, variant", kind_variants(), ids=lambda v: str(v))
def test_objective_and_drafter_keep_their_bases_signatures(kind, variant):
    """Every kind's, and every variant's, which subclass their kind's head, config, objective and drafter."""
    assert drift(Objective, objective_class(kind, variant)) == []
    assert drift(HeadDrafter, drafter_class(kind, variant)) == []
    if variant is not None:
        head = head_class(kind, variant)
        assert head is not HEAD_CLASSES[kind] and issubclass(head, HEAD_CLASSES[kind])
        assert issubclass(head.config_class, HEAD_CLASSES[kind].config_class) and head.config_class.variant == variant
        assert objective_class(kind, variant) is not objective_class(kind)
        assert issubclass(objective_class(kind, variant), objective_class(kind))
        assert drafter_class(kind, variant) is not drafter_class(kind)
        assert issubclass(drafter_class(kind, variant), drafter_class(kind))


def _modules(package) -> set[str]:
    return {m.name for m in pkgutil.iter_modules(package.__path__)}


def unregistered_variants() -> list[str]:
    """What variants/ folders hold that ``heads.kinds.VARIANT_CLASSES`` does not register, and registered variants
    the contract cases below leave out: every head class in heads/variants/ and every module of the three
    folders must be a registered variant's."""
    registered = {variant for _, variant in VARIANT_CLASSES}
    found = []
    for name in _modules(head_variants):
        module = importlib.import_module(f"{head_variants.__name__}.{name}")
        found += [f"heads.variants.{name}.{obj.__name__}" for obj in vars(module).values()
                  if isinstance(obj, type) and issubclass(obj, DraftHead) and obj.__module__ == module.__name__
                  and obj not in VARIANT_CLASSES.values()]
    for package in (head_variants, objective_variants, drafter_variants):
        found += [f"{package.__name__}.{name}" for name in sorted(_modules(package) - registered)]
    return found + [f"case {variant}" for variant in sorted(registered - set(CASES))]


def test_every_variant_is_registered_and_checked():
    assert unregistered_variants() == []
    assert len(VARIANT_CLASSES) == 3  # the walk above finds P-EAGLE, DSpark and Domino (it checked something)


def test_drift_finds_a_changed_signature():
    """The check above can fail: a features() without ``states`` (what early-exit's once was) and a
    propose_rows() with a renamed parameter are found."""
    class NoStates(Objective):
        @staticmethod
        def features(target, batch, head, need_top1=False):
            raise NotImplementedError

    class Renamed(HeadDrafter):
        def propose_rows(self, states, tokens, sampling, max_depths):
            raise NotImplementedError

    class Unbound(Objective):
        def configure(self, cfg):  # an instance method: train.config calls the hook on the class
            raise NotImplementedError

    assert [line.split("(")[0] for line in drift(Objective, NoStates)] == ["NoStates.features"]
    assert [line.split("(")[0] for line in drift(HeadDrafter, Renamed)] == ["Renamed.propose_rows"]
    assert [line.split("(")[0] for line in drift(Objective, Unbound)] == ["Unbound.configure"]


# settings a reader takes only beside another one (the objective refuses them alone in one line)
COMPANIONS = {"train.law_weight": ["train.labels=top1"]}


def _setting(setting: str) -> tuple[str, str]:
    """``(override, refusal)``: a value for ``setting`` away from its default, as ``key=value``, and the start of
    the config's message when a kind that does not read it is given it."""
    key, _, value = setting.partition("=")
    section, name = key.split(".")
    cls = typing.get_type_hints(TrainConfig)[section]
    hint = typing.get_type_hints(cls)[name]
    assert name in {f.name for f in dataclasses.fields(cls)}, f"{setting}: no such key"
    if value:
        assert value in typing.get_args(hint), f"{setting}: {value!r} is not a value of {key}"
        return setting, setting
    default = {f.name: f.default for f in dataclasses.fields(cls)}[name]
    if typing.get_origin(hint) is typing.Literal:  # a choice: its first value other than the default
        return f"{key}={next(v for v in typing.get_args(hint) if v != default)}", key
    sample = {bool: str(not default).lower(), int: "2", float: "0.5"}  # a bool: the other value than its default
    kind = next(t for t in (bool, int, float) if t is hint or t in typing.get_args(hint))
    return f"{key}={sample[kind]}", key


@pytest.mark.parametrize("kind", KINDS)
def test_an_objective_declares_its_settings_and_configures_through_the_base_hook(kind):
    """``configure`` is the base's classmethod hook (train.config calls it on the class); every setting in
    ``reads`` names a real key (a head.* one its head config does not take, else build_head would get it too)."""
    cls = objective_class(kind)
    assert "configure" in _members(Objective)
    assert isinstance(inspect.getattr_static(cls, "configure"), classmethod), f"{kind}: configure is no classmethod"
    assert inspect.signature(cls.configure) == inspect.signature(Objective.configure)
    options = config_options(HEAD_CLASSES[kind].config_class)
    for setting in cls.reads:
        _setting(setting)
        assert setting.removeprefix("head.") not in options, f"{kind}: {setting} is a head config option"


def test_the_config_takes_a_setting_exactly_from_the_kinds_whose_objective_reads_it():
    """For every declared setting and every kind: accepted where the objective reads it (under the variant that reads
    it, for a setting the objective reads under one variant only: ``variant_settings``), refused elsewhere in one
    line naming the setting and the kinds that read it; refused under the kind's other variants in one line."""
    declared = dict.fromkeys(setting for kind in KINDS for setting in objective_class(kind).reads)
    assert declared, "no kind declares a setting: the check below checks nothing"
    for setting in declared:
        override, refusal = _setting(setting)
        readers = [kind for kind in KINDS if setting in objective_class(kind).reads]
        for kind in KINDS:
            overrides = [f"head.kind={kind}", override, "train.init_from=x"]  # on-policy continues a trained head
            if kind in readers:  # what a reader needs beside it (refused without: its own tests)
                overrides += COMPANIONS.get(setting, [])
            variant = getattr(objective_class(kind), "variant_settings", {}).get(setting)
            if kind in readers and variant:
                with pytest.raises(ConfigError, match=f"^{re.escape(override)} applies only to head.variant={variant} "):
                    load_config(None, overrides)
                load_config(None, [*overrides, f"head.variant={variant}"])
                continue
            if kind in readers:
                load_config(None, overrides)
                continue
            with pytest.raises(ConfigError, match=f"^{re.escape(refusal)} applies only to "
                                                  f"head.kind={re.escape('/'.join(readers))} "):
                load_config(None, overrides)


def test_the_config_names_no_kind():
    """What a kind reads, fills and refuses lives in its objective: train/config.py names none of them."""
    source = (REPO / "train" / "config.py").read_text()
    assert [kind for kind in KINDS if f'"{kind}"' in source or f"'{kind}'" in source] == []


@pytest.mark.parametrize("case", CASES)
def test_a_kind_trains_a_step_online_and_from_stored_states(case, target):
    kind, small = CASES[case]
    cfg = load_config(None, [f"head.kind={kind}", *small])
    for key in ("data.features=stored", "data.feature_cache=cache"):  # both accepted at parse time
        assert load_config(None, [f"head.kind={kind}", key]).head.kind == kind
    torch.manual_seed(0)
    head = build_head(kind, target, **cfg.head.build_options())
    cls = objective_class(kind, cfg.head.variant)
    objective = cls(head, cfg)
    assert type(head) is head_class(kind, cfg.head.variant) and type(objective) is cls
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
