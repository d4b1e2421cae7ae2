"""``train.init_from`` an export: a run warm-started from a head's export, in each format our importers read
(SpecForge's / vLLM's EAGLE-3 layout and speculators for EAGLE-3; speculators and z-lab's layout for DFlash;
speculators and DeepSpec's layout for DSpark; SpecForge's DominoDraftModel for Domino), takes the same first loss as one warm-started from the head's
own directory; a checkpoint that does not fit the target is refused in one line naming each misfit."""
from __future__ import annotations

import pytest
import torch
from support.train_fixtures import tiny_config, tiny_files  # noqa: F401  (fixture)

from draftsmith.data.targets import load_target
from draftsmith.heads import AutoHead, build_head
from draftsmith.heads.formats import export_head
from draftsmith.train.run import setup
from draftsmith.train.warm_start import warm_start

DFLASH = ["head.kind=dflash", "head.block_size=4", "head.num_layers=1"]
CASES = {"eagle3": (["head.kind=eagle3"], ("vllm", "speculators")),
         "dflash": (DFLASH, ("speculators", "dflash")),
         "dspark": ([*DFLASH, "head.variant=dspark"], ("speculators", "dspark")),
         "domino": ([*DFLASH, "head.variant=domino", "head.gru_hidden_dim=8", "head.emb_dim=8"], ("dflash",))}


def _first_loss(files, out, options, source) -> float:
    run = setup(tiny_config(files, out, *options, "train.max_steps=1", "train.eval_every=0", "train.log_every=1",
                            f"train.init_from={source}"))
    return run.history[0]["loss"]


@pytest.mark.parametrize("case", CASES)
def test_init_from_an_export_starts_where_its_head_was(case, tiny_files, tmp_path):  # noqa: F811
    options, formats = CASES[case]
    trained = setup(tiny_config(tiny_files, tmp_path / "base", *options, "train.max_steps=3", "train.eval_every=0"))
    head = AutoHead.from_pretrained(trained.output_dir)
    target = load_target(str(tiny_files["target"]))
    reference = _first_loss(tiny_files, tmp_path / "native", options, trained.output_dir)
    for fmt in formats:
        out = export_head(head, tmp_path / f"export-{fmt}", fmt, target=target,
                          **({"verifier": "org/tiny"} if fmt == "speculators" else {}))
        assert _first_loss(tiny_files, tmp_path / f"from-{fmt}", options, out) == reference, fmt


def test_a_checkpoint_that_does_not_fit_the_target_is_one_line(tiny_files, tmp_path):  # noqa: F811
    """A DFlash export of a head for a target with another vocabulary and deeper layer ids: refused naming both;
    the same head with another block size (fits the target): refused naming the key."""
    from support.targets import make_tiny_target

    other = make_tiny_target("llama", vocab_size=120, num_layers=10)
    head = build_head("dflash", other, block_size=4, num_layers=1, aux_layer_ids=[8])
    out = export_head(head, tmp_path / "other", "dflash", target=other)
    target = load_target(str(tiny_files["target"]))
    fresh = build_head("dflash", target, block_size=4, num_layers=1)
    with pytest.raises(ValueError, match=r"does not fit this run's target \(checkpoint vs target\): vocab_size: 120 "
                                         r"vs \d+; layer ids: \[8\] read past the target's \d+ layers") as err:
        warm_start(fresh, str(out))
    assert "\n" not in str(err.value)
    same = build_head("dflash", target, block_size=4, num_layers=1)
    out = export_head(same, tmp_path / "same", "dflash", target=target)
    with pytest.raises(ValueError, match=r"block_size: 4 \(init_from\) vs 5 \(this run\)"):
        warm_start(build_head("dflash", target, block_size=5, num_layers=1), str(out))
    warm_start(fresh, str(out))
    assert all(torch.equal(v, same.state_dict()[k]) for k, v in fresh.state_dict().items())
