"""`draftsmith check-export`: an export loaded by its consumer's own code (speculators 0.9.0, in its venv)
drafts what the head drafts, and planted mismatches (a flipped causal flag, a missing tensor, the other
norm_output meaning) exit 1. The library runs where ``DRAFTSMITH_SPECULATORS_PYTHON`` or the venv of
``heads.formats.parity`` imports it (``draftsmith check-export ... --install`` creates it; CI's ``.ci/run``
builds it before the suite, so in CI (``CI`` set) they fail without it); elsewhere those tests skip and the
config/tensor-level ones below still run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.targets import make_tiny_target
from support.formats import perturb
from support.check_export import check, check_export_plant, export

from draftsmith.heads import build_head
from draftsmith.heads.formats import export_head, validate_export
from draftsmith.heads.formats.parity import compare_steps, compare_tensors, venv_dir
from draftsmith.scripts.check_export import cli as check_cli

L = 8


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory):
    """Tiny Llama and Qwen3 targets saved to disk: the library reads its verifier's weights by path."""
    root = tmp_path_factory.mktemp("verifiers")
    out = {}
    for arch in ("llama", "qwen3"):
        model = make_tiny_target(arch, num_layers=L)
        model.save_pretrained(root / arch)
        model.config._name_or_path = str(root / arch)
        out[arch] = model
    return out


EAGLE3_VARIANTS = {"plain": {}, "fc_norm": {"fc_norm": True}, "norm_output": {"norm_output": True},
                   "reduced": {"draft_vocab_size": 40}}


@pytest.mark.parametrize("variant", sorted(EAGLE3_VARIANTS))
def test_eagle3_exports_draft_alike_in_the_library(tmp_path, verifiers, capsys, variant):
    target = verifiers["llama"]
    head = build_head("eagle3", target, **EAGLE3_VARIANTS[variant])
    if variant == "reduced":
        head.set_draft_vocab(torch.arange(0, 80, 2))
    out, head_dir = export(tmp_path, perturb(head), target)
    code, printed = check(out, head_dir, target, capsys)
    assert code == 0, printed
    assert printed.count("drafted tokens") == 3 and "MISMATCH" not in printed and "parity: ok" in printed
    assert "loaded exactly" in printed


def test_dflash_export_drafts_alike_in_the_library(tmp_path, verifiers, capsys):
    target = verifiers["qwen3"]
    head = perturb(build_head("dflash", target, num_layers=2, block_size=4, mask_token_id=90))
    out, head_dir = export(tmp_path, head, target)
    code, printed = check(out, head_dir, target, capsys)
    assert code == 0 and "tensors: 25/25 loaded exactly" in printed and "dflash_config.causal=false ok" in printed
    assert "--head: the export is what dflash head" in printed and "parity: ok" in printed
    assert [line.split(":")[0] for line in printed.splitlines() if "drafted tokens" in line] == \
        ["block position 1", "block position 2", "block position 3"]  # the drafts; position 0 is the anchor


def test_peagle_export_drafts_alike_in_the_library(tmp_path, verifiers, capsys):
    """speculators 0.9.0's PEagleDraftModel loads a P-EAGLE export and computes every depth as the head does."""
    target = verifiers["llama"]
    head = perturb(build_head("eagle3", target, variant="peagle", num_depths=3))
    out, head_dir = export(tmp_path, head, target)
    code, printed = check(out, head_dir, target, capsys)
    assert code == 0 and "tensors: 15/15 loaded exactly" in printed and "parity: ok" in printed, printed
    assert [line.split(":")[0] for line in printed.splitlines() if "drafted tokens" in line] == \
        ["depth 0", "depth 1", "depth 2"]


def test_a_peagle_export_with_another_shared_hidden_state_fails(tmp_path, verifiers, capsys):
    """A planted mask_hidden (zeroed in the file): the library loads it, depth 0 still agrees, every mask depth not."""
    target = verifiers["llama"]
    out, head_dir = export(tmp_path, perturb(build_head("eagle3", target, variant="peagle", num_depths=3)), target)
    check_export_plant(out, tensor_edit=lambda t: t["mask_hidden"].zero_())
    code, printed = check(out, head_dir, target, capsys)
    depths = [line for line in printed.splitlines() if line.startswith("depth")]
    assert code == 1 and depths[0].endswith("ok") and all(d.endswith("MISMATCH") for d in depths[1:]), printed
    assert "mask_hidden: loaded values differ" in printed


def test_a_flipped_causal_flag_fails(tmp_path, verifiers, capsys):
    target = verifiers["qwen3"]
    out, head_dir = export(tmp_path, perturb(build_head("dflash", target, block_size=4, mask_token_id=90)), target)
    check_export_plant(out, lambda c: c.update(sliding_window_non_causal=False))  # what the export wrote before
    code, printed = check(out, head_dir, target, capsys)
    assert code == 1 and "dflash_config.causal=true MISMATCH" in printed, printed


def test_a_missing_embedding_fails(tmp_path, verifiers, capsys):
    """The export as it was before: no embed_tokens.weight, so the library drafts from whatever its own
    uninitialised embedding holds."""
    target = verifiers["llama"]
    out, head_dir = export(tmp_path, perturb(build_head("eagle3", target)), target)
    check_export_plant(out, tensor_edit=lambda t: t.pop("embed_tokens.weight"))
    code, printed = check(out, head_dir, target, capsys)
    assert code == 1 and "missing tensors ['embed_tokens.weight']" in printed and "parity: MISMATCH" in printed


def test_the_other_norm_output_meaning_fails(tmp_path, verifiers, capsys):
    """A norm_output head exported with the flag false (SpecForge's meaning of our true): the library feeds
    the pre-norm state forward, so step 0 agrees and the later steps do not."""
    target = verifiers["llama"]
    out, head_dir = export(tmp_path, perturb(build_head("eagle3", target, norm_output=True)), target)
    check_export_plant(out, lambda c: c.update(norm_output=False))
    code, printed = check(out, head_dir, target, capsys)
    lines = [line for line in printed.splitlines() if line.startswith("step")]
    assert code == 1 and lines[0].endswith("ok") and lines[1].endswith("MISMATCH"), printed


def _earlier_layers(key):
    """Each aux layer id one lower, in the config and (EAGLE-3) in the provenance record validation reads."""
    def edit(config):
        config[key] = [i - 1 for i in config[key]]
        if "aux_layer_ids" in config["draftsmith"]:
            config["draftsmith"]["aux_layer_ids"] = config[key]
    return edit


@pytest.mark.parametrize("kind,arch,options,key", [
    ("eagle3", "llama", {}, "eagle_aux_hidden_state_layer_ids"),
    ("dflash", "qwen3", {"block_size": 4, "mask_token_id": 90}, "aux_hidden_state_layer_ids"),
])
def test_a_changed_layer_list_the_library_never_reads_fails(tmp_path, verifiers, capsys, kind, arch, options, key):
    """The library drafts from target states we compute with the head's own aux layers, so an export whose
    layer list vLLM would read differently drafts alike there (every step ok) and passed (exit 0); it is
    also compared with what --head exports now, which names the key (validation does not see it: the EAGLE-3
    provenance record is edited alike)."""
    target = verifiers[arch]
    out, head_dir = export(tmp_path, perturb(build_head(kind, target, **options)), target)
    check_export_plant(out, _earlier_layers(key))
    code, printed = check(out, head_dir, target, capsys)
    drafts = [line for line in printed.splitlines() if "drafted tokens" in line]
    assert drafts and all(line.endswith(" ok") for line in drafts), printed
    assert "config/tensors: valid 'speculators' export" in printed, printed
    assert code == 1 and f"--head: config {key}: export " in printed and "parity: MISMATCH" in printed, printed


# ------------------------------------------------------------------ config/tensor level: everywhere


def test_dflash_speculators_export_declares_non_causal_attention(tmp_path, verifiers):
    """vLLM's update_dflash: dflash_config.causal = not sliding_window_non_causal; today's false is refused."""
    target = verifiers["qwen3"]
    out, _ = export(tmp_path, perturb(build_head("dflash", target, block_size=4, mask_token_id=90)), target)
    assert json.loads((out / "config.json").read_text())["sliding_window_non_causal"] is True
    check_export_plant(out, lambda c: c.update(sliding_window_non_causal=False))
    with pytest.raises(ValueError, match="sliding_window_non_causal=False: vLLM's update_dflash would make every"):
        validate_export(out, "speculators")


def test_compare_steps_and_tensors_name_each_mismatch():
    a = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    lines, ok = compare_steps([a, a], [a, a + 1e-6], atol=1e-4)
    assert ok and lines[1].startswith("step 1: max |logit diff| 1e-06, drafted tokens 2/2 equal ok")
    lines, ok = compare_steps([a], [a.flip(-1)], atol=1e-4)
    assert not ok and "drafted tokens 0/2 equal MISMATCH" in lines[0]
    lines, ok = compare_steps([a], [torch.full_like(a, float("nan"))], atol=1e-4)
    assert not ok
    lines, ok = compare_tensors({"w": a, "v": a}, {"w": a, "v": a + 1})
    assert not ok and lines[0].startswith("v: loaded values differ") and lines[-1] == "tensors: 1/2 loaded exactly"


def test_without_the_library_the_check_says_how_to_install_it(tmp_path, verifiers, capsys, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_VENVS", str(tmp_path / "venvs"))
    assert venv_dir() == tmp_path / "venvs" / "speculators-0.9.0"
    target = verifiers["llama"]
    out, head_dir = export(tmp_path, perturb(build_head("eagle3", target)), target)
    assert check_cli([str(out), "--head", str(head_dir), "--target", target.config._name_or_path]) == 2
    assert "pass --install to create it" in capsys.readouterr().err
    assert not (tmp_path / "venvs").exists()  # never created unasked


def test_usage_mistakes_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert check_cli([str(tmp_path / "none"), "--head", "h", "--target", "t"]) == 2
    assert "config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert check_cli([str(tmp_path), "--head", "h", "--target", "t"]) == 2
    assert "no draftsmith provenance" in capsys.readouterr().err
    assert check_cli([str(tmp_path), "--head", "h", "--target", "t", "--tokens", "3", "--steps", "3"]) == 2
    assert "--tokens 3 must exceed --steps 3" in capsys.readouterr().err


# ------------------------------------------------------------------ vllm / dflash exports against --head


def _engine_export(tmp_path, target, kind, fmt, name="export", shift=0.0, **options):
    head = perturb(build_head(kind, target, **options))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(shift)
    head_dir = tmp_path / f"{name}-head"
    head.save_pretrained(head_dir)
    return export_head(head, tmp_path / name, fmt, target=target), head_dir


@pytest.mark.parametrize("kind,fmt,options,plant,named", [
    ("eagle3", "vllm", {"norm_output": True}, lambda c: c.pop("norm_output"), "config norm_output"),
    ("eagle3", "vllm", {}, lambda c: c.update(norm_output=True), "config norm_output"),
    ("dflash", "dflash", {"block_size": 4, "mask_token_id": 90}, lambda c: c.update(block_size=5),
     "config block_size: export 5, --head writes 4"),
])
def test_an_engine_export_that_is_not_the_head_s_fails(tmp_path, verifiers, capsys, kind, fmt, options, plant, named):
    """vllm and dflash exports (no consumer library here) are compared with what --head exports now: the good
    export passes, a flipped norm_output or a changed block size exits 1 naming the key."""
    target = verifiers["llama" if kind == "eagle3" else "qwen3"]
    out, head_dir = _engine_export(tmp_path, target, kind, fmt, **options)
    argv = [str(out), "--head", str(head_dir), "--target", target.config._name_or_path]
    assert check_cli(argv) == 0, capsys.readouterr().out
    assert "export: ok" in capsys.readouterr().out
    check_export_plant(out, plant)
    code, printed = check_cli(argv), capsys.readouterr().out
    assert code == 1 and named in printed and "export: MISMATCH" in printed, printed


@pytest.mark.parametrize("kind,fmt,options", [("eagle3", "vllm", {}),
                                              ("dflash", "dflash", {"block_size": 4, "mask_token_id": 90})])
def test_another_head_s_export_fails(tmp_path, verifiers, capsys, kind, fmt, options):
    target = verifiers["llama" if kind == "eagle3" else "qwen3"]
    out, _ = _engine_export(tmp_path, target, kind, fmt, name="one", **options)
    _, other = _engine_export(tmp_path, target, kind, fmt, name="two", shift=0.01, **options)
    code = check_cli([str(out), "--head", str(other), "--target", target.config._name_or_path])
    printed = capsys.readouterr().out
    assert code == 1 and "differs from --head's MISMATCH" in printed and "export: MISMATCH" in printed, printed


def test_the_venv_is_built_from_the_running_interpreter_with_its_torch(tmp_path, monkeypatch):
    """From a venv (README's install), the speculators venv must see this interpreter's packages (its torch)
    and pip must be held to the installed torch: the base interpreter's venv saw no torch, and pip pulled
    a multi-GB CUDA build. The commands are recorded here, not run (pip downloads)."""
    import sysconfig

    from draftsmith.heads.formats import parity

    venv = tmp_path / "venvs" / "speculators-0.9.0"
    purelib = tmp_path / "purelib"
    purelib.mkdir()
    calls = []

    def fake_run(cmd, **kwargs):
        constraint = kwargs.get("env", {}).get("PIP_CONSTRAINT")
        calls.append((cmd, Path(constraint).read_text() if constraint else None))
        return subprocess.CompletedProcess(cmd, 0, stdout=f"{purelib}\n", stderr="")

    monkeypatch.setattr(parity.subprocess, "run", fake_run)
    parity.build_venv(venv)
    assert calls[0][0][:3] == [sys.executable, "-m", "venv"] and "--system-site-packages" in calls[0][0]
    pth = (purelib / "draftsmith-parent.pth").read_text().split()
    assert sysconfig.get_paths()["purelib"] in pth  # where this interpreter's torch and draftsmith live
    installs = [(cmd, constraint) for cmd, constraint in calls if "install" in cmd]
    assert len(installs) == 2 and all(cmd[0] == str(venv / "bin" / "python") for cmd, _ in installs)
    assert all(constraint == f"torch=={torch.__version__}\n" for _, constraint in installs)
    assert all("--no-warn-conflicts" in cmd for cmd, _ in installs)  # speculators' own pins are not ours, on purpose


def test_install_that_does_not_yield_the_library_says_why(tmp_path, monkeypatch):
    """--install given: the venv is built, and if it still does not import speculators the error names the
    import failure, not "pass --install"."""
    from draftsmith.heads.formats import parity

    monkeypatch.setenv("DRAFTSMITH_VENVS", str(tmp_path))
    monkeypatch.setattr(parity, "build_venv", lambda venv: (venv / "bin").mkdir(parents=True) or
                        (venv / "bin" / "python").symlink_to(sys.executable))
    with pytest.raises(FileNotFoundError, match="was built but does not import it: ModuleNotFoundError: No module "
                                                "named 'speculators'") as err:
        parity.speculators_python(create=True)
    assert "pass --install" in str(err.value)  # only as the way to rebuild after removing it


def test_a_missing_causal_flag_is_named_as_vllm_reads_it(tmp_path, verifiers):
    """vLLM's update_dflash reads a missing sliding_window_non_causal as true (dflash_config.causal = not
    get(..., True)): the refusal must not say vLLM would run the blocks causally."""
    target = verifiers["qwen3"]
    out, _ = export(tmp_path, perturb(build_head("dflash", target, block_size=4, mask_token_id=90)), target)
    check_export_plant(out, lambda c: c.pop("sliding_window_non_causal"))
    with pytest.raises(ValueError, match="sliding_window_non_causal is missing: vLLM's update_dflash reads that as "
                                         "true") as err:
        validate_export(out, "speculators")
    assert "would make every draft layer causal" not in str(err.value)


def test_a_missing_export_is_one_line_before_torch_loads(tmp_path):
    probe = ("import sys\nfrom draftsmith.scripts.check_export import cli\n"
             f"code = cli([{str(tmp_path / 'none')!r}, '--head', 'h', '--target', 't'])\n"
             "print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "none/config.json: no such file" in done.stderr


def test_one_library_process_answers_every_request_and_survives_an_error(tmp_path):
    """``run_speculators`` keeps one process per interpreter: here an interpreter without the library, whose
    every request fails in one line naming the export, answered by the same process each time; an
    interpreter that cannot serve is named with its last words."""
    from draftsmith.heads.formats import parity

    inputs = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
    pids = []
    for name in ("a", "b"):
        with pytest.raises(RuntimeError, match=rf"could not load {tmp_path / name}: ModuleNotFoundError: No module "
                                               r"named 'speculators'$"):
            parity.run_speculators(Path(sys.executable), tmp_path / name, "org/tiny", inputs)
        pids.append(parity._CONSUMERS[sys.executable][0].pid)
    assert pids[0] == pids[1]
    with pytest.raises(RuntimeError, match=r"could not load .*/c: .*--serve"):
        parity.run_speculators(Path("/bin/ls"), tmp_path / "c", "org/tiny", inputs)
