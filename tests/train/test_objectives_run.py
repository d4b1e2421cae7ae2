"""Every training stage and objective setting changes what is trained: a run with it and its control (the same
steps, data, seed and start without it) end in different weights. Each check is shown able to fail: the bug
it guards against is planted (the on-policy rollout skipped, D-PACE trained as CE, DFlash's anchor count or
gamma ignored) and the two runs then end in the same weights, which the check reports.

Runs are two steps of a tiny head on tests/support/train_fixtures.py's data (seconds each)."""
from __future__ import annotations

import math

import pytest
import torch
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.train.objectives import dflash as dflash_objective
from draftsmith.train.objectives.dflash import DFlashObjective, default_gamma
from draftsmith.train.objectives.eagle3 import Eagle3Objective
from draftsmith.train.run import setup

KINDS = {"dflash": ["head.kind=dflash", "head.block_size=4", "head.num_layers=1", "train.anchors_per_document=4"],
         "eagle3": ["head.kind=eagle3", "head.ttt_steps=2"]}  # its supervised loss reads every position
STEPS = ["train.max_steps=2", "train.warmup_steps=0", "train.log_every=1", "data.eval=null", "train.lr=1e-2"]


def trained(files, root, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    """The head's weights after a short run with ``overrides``."""
    return {k: v.clone() for k, v in setup(tiny_config(files, root / name, *STEPS, *overrides)).head.state_dict().items()}


def differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The check: the two runs trained different weights."""
    return any(not torch.equal(a[name], b[name]) for name in a)


def planted_init(monkeypatch, cls, **attributes) -> None:
    """A plant: ``cls``'s objective sets ``attributes`` after its own ``__init__`` (what it would do if it ignored
    the setting they come from)."""
    original = cls.__init__

    def init(self, head, cfg):
        original(self, head, cfg)
        for name, value in attributes.items():
            setattr(self, name, value)

    monkeypatch.setattr(cls, "__init__", init)


@pytest.fixture(scope="module")
def starts(tiny_files, tmp_path_factory):  # noqa: F811
    """A supervised head of each kind that the on-policy stage and its control continue."""
    root = tmp_path_factory.mktemp("starts")
    return {kind: setup(tiny_config(tiny_files, root / kind, *KINDS[kind], *STEPS)).output_dir for kind in KINDS}


def _stage_and_control(files, root, start, kind) -> tuple[dict, dict]:
    """The on-policy stage and its control (lab/acceptance_curve.py's): the same start, steps, loss and lr."""
    common = [*KINDS[kind], f"train.init_from={start}", "train.loss=ce"]
    roots = [] if kind == "dflash" else ["train.anchors_per_document=4"]  # EAGLE-3's chains: the stage's own
    return (trained(files, root, "stage", *common, "train.stage=on-policy", *roots),
            trained(files, root, "control", *common))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_on_policy_stage_trains_what_its_control_does_not(tiny_files, starts, tmp_path, kind):  # noqa: F811
    stage, control = _stage_and_control(tiny_files, tmp_path, starts[kind], kind)
    assert differs(stage, control)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_check_fails_when_the_rollout_is_skipped(tiny_files, starts, tmp_path, monkeypatch, kind):  # noqa: F811
    """The plant: train/fit.py's rollout call taken out (the objective's rollout does nothing); the stage then
    trains its supervised loss, exactly the control."""
    cls = DFlashObjective if kind == "dflash" else Eagle3Objective
    monkeypatch.setattr(cls, "rollout", lambda self, features, target, cfg, seed: None)
    stage, control = _stage_and_control(tiny_files, tmp_path, starts[kind], kind)
    assert not differs(stage, control)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("planted", [False, True])
def test_d_pace_trains_other_weights_than_ce(tiny_files, tmp_path, monkeypatch, kind, planted):  # noqa: F811
    """D-PACE against CE from the same start; planted: the objective trains CE whatever train.loss says."""
    if planted:
        planted_init(monkeypatch, DFlashObjective if kind == "dflash" else Eagle3Objective, loss="ce")
    dpace = trained(tiny_files, tmp_path, "dpace", *KINDS[kind], "train.loss=dpace")
    ce = trained(tiny_files, tmp_path, "ce", *KINDS[kind], "train.loss=ce")
    assert differs(dpace, ce) != planted


@pytest.mark.parametrize("planted", [False, True])
def test_dflash_anchor_count_changes_the_training(tiny_files, tmp_path, monkeypatch, planted):  # noqa: F811
    """train.anchors_per_document 2 against 6; planted: the objective draws 4 whatever it is told."""
    if planted:
        draw = dflash_objective.draw_anchors
        monkeypatch.setattr(dflash_objective, "draw_anchors", lambda mask, count, generator, **kw: draw(mask, 4, generator, **kw))
    base = [s for s in KINDS["dflash"] if not s.startswith("train.anchors_per_document")]
    two = trained(tiny_files, tmp_path, "two", *base, "train.anchors_per_document=2")
    six = trained(tiny_files, tmp_path, "six", *base, "train.anchors_per_document=6")
    assert differs(two, six) != planted


@pytest.mark.parametrize("planted", [False, True])
def test_dflash_gamma_changes_the_training(tiny_files, tmp_path, monkeypatch, planted):  # noqa: F811
    """train.gamma 0.5 against 8 (block positions weighted exp(-(k-1)/gamma)); planted: the block size's default."""
    if planted:
        planted_init(monkeypatch, DFlashObjective, decay=math.exp(-1 / default_gamma(4)))
    short = trained(tiny_files, tmp_path, "short", *KINDS["dflash"], "train.gamma=0.5")
    long = trained(tiny_files, tmp_path, "long", *KINDS["dflash"], "train.gamma=8")
    assert differs(short, long) != planted
