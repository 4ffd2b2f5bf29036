"""The audit's security, data-loss and silently-wrong cases (issue 36), one process each:
config components that run programs, planted DCP `.metadata` pickles, symbolic links in an
HF export's source folder, a user's file in an export folder, damaged `.distcp` files
(checksums), and a full disk during the final export."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from freetx.checkpoint import convert, inspect_report, open_tensors
from freetx.checkpoint.checkpointer import build_meta
from freetx.checkpoint.dcp_folder import CHECKSUMS, META_FILE, fold_checksums
from freetx.checkpoint.loading import weight_source
from freetx.checkpoint.run_folder import plan_resume
from freetx.checkpoint.saver import _Writer
from freetx.distributed import materialize
from freetx.errors import CheckpointError, FreetxError
from freetx.models.transformer import decoder
from freetx.training.export import export_final
from tests.conftest import REPO, flat, one_paragraph, run_freetx_here

RECIPE = ("--recipe", "full_finetune_fsdp2")


# -- components that run programs ----------------------------------------------------------


def hostile_config(tmp_path: Path, node: str, component: dict) -> tuple[Path, Path]:
    """llm/tiny with `component` at `node`, writing into tmp_path; and the file its command
    would create."""
    marker = tmp_path / "PWNED"
    cfg = OmegaConf.load(REPO / "recipe_configs" / "llm" / "tiny.yaml")
    OmegaConf.update(cfg, node, component, force_add=True)
    cfg.output_dir = str(tmp_path / "run")
    path = tmp_path / "hostile.yaml"
    path.write_text(OmegaConf.to_yaml(cfg).replace("MARKER", str(marker)))
    return path, marker


OS_SYSTEM = {"_component_": "os.system", "command": "touch MARKER"}


@pytest.mark.parametrize(
    "command",
    [("validate",), ("estimate", "--world-size", "1"), ("data", "prepare")],
    ids=["validate", "estimate", "data_prepare"],
)
def test_component_os_system_in_dataset_cache_dir_is_refused(tmp_path, command):
    config, marker = hostile_config(tmp_path, "dataset.cache_dir", OS_SYSTEM)
    result = run_freetx_here(*command, str(config), *RECIPE)
    text = flat(result.stdout + result.stderr)
    assert result.returncode == 1, text
    assert "dataset.cache_dir._component_: 'os.system' is refused" in text
    assert "--trust os" in text and "docs/trust.md" in text
    assert not marker.exists()


def test_component_trusted_for_the_command_passes_validate(tmp_path):
    config, marker = hostile_config(tmp_path, "dataset.cache_dir", OS_SYSTEM)
    result = run_freetx_here("validate", str(config), *RECIPE, "--trust", "os.system")
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
    assert not marker.exists()  # validate builds nothing


def test_a_component_of_the_users_own_module_needs_trust(tmp_path, monkeypatch):
    (tmp_path / "my_lengths.py").write_text("def seq_len():\n    return 128\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config, _ = hostile_config(tmp_path, "model.max_seq_len",
                               {"_component_": "my_lengths.seq_len"})  # fmt: skip
    refused = run_freetx_here("estimate", str(config), *RECIPE, "--world-size", "1")
    assert refused.returncode == 1 and "--trust my_lengths" in flat(refused.stderr)
    result = run_freetx_here(
        "estimate", str(config), *RECIPE, "--world-size", "1", "--trust", "my_lengths"
    )
    assert result.returncode == 0, result.stderr


# -- a tiny checkpoint, made in this process -----------------------------------------------


def save_checkpoint(folder: Path, step: int) -> Path:
    """A DCP checkpoint of the tiny decoder as the checkpointer writes it (its writer, which
    records each rank's checksums, and meta.json with them folded in)."""
    with torch.device("meta"):
        model = decoder("tiny")
    materialize(model, torch.device("cpu"), seed=step)
    path = folder / f"step_{step:06d}"
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state["optimizer.step"] = torch.tensor(float(step))
    dcp.save(state, storage_writer=_Writer(str(path)), no_dist=True)
    meta = {**build_meta(model, 1, "fsdp"), "step": step}
    meta[CHECKSUMS] = fold_checksums(path)
    (path / META_FILE).write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """checkpoints/ with step_000002 and step_000004."""
    checkpoints = tmp_path_factory.mktemp("run") / "checkpoints"
    save_checkpoint(checkpoints, 2)
    save_checkpoint(checkpoints, 4)
    (checkpoints / "LATEST").write_text("step_000004\n")
    return checkpoints


@pytest.fixture
def checkpoints(saved, tmp_path) -> Path:
    copy = tmp_path / "run" / "checkpoints"
    shutil.copytree(saved, copy)
    return copy


# -- a planted .metadata ---------------------------------------------------------------------


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(checkpoint: Path, tmp_path: Path) -> Path:
    marker = tmp_path / "PWNED"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    return marker


def test_planted_metadata_is_refused_by_inspect_convert_and_initial_weights(checkpoints, tmp_path):
    step = checkpoints / "step_000004"
    marker = plant(step, tmp_path)
    for read in (
        lambda: inspect_report(step),
        lambda: convert(step, tmp_path / "m.safetensors"),
        lambda: weight_source(str(step)).tensors,
    ):
        with pytest.raises(CheckpointError, match="is not a DCP metadata file") as e:
            read()
        assert f"{step / '.metadata'}" in str(e.value) and "names posix.system" in str(e.value)
    result = run_freetx_here("checkpoint", "inspect", str(step))
    assert "is not a DCP metadata file" in one_paragraph(result)
    assert not marker.exists()


def test_planted_metadata_is_refused_by_the_resume_scan(checkpoints, tmp_path):
    shutil.rmtree(checkpoints / "step_000002")
    marker = plant(checkpoints / "step_000004", tmp_path)
    with pytest.raises(CheckpointError) as e:
        plan_resume(checkpoints, "auto", False, 10, {}, ())
    assert ".metadata is not a DCP metadata file (its pickle names posix.system)" in str(e.value)
    assert not marker.exists()


# -- damaged data files: checksums -----------------------------------------------------------


def flip(file: Path, at: int = 20_000, size: int = 4096) -> None:
    data = bytearray(file.read_bytes())
    data[at : at + size] = bytes(b ^ 0xFF for b in data[at : at + size])
    file.write_bytes(bytes(data))


def test_flipped_distcp_bytes_are_refused_by_inspect_convert_and_resume(checkpoints, tmp_path):
    step = checkpoints / "step_000004"
    flip(step / "__0_0.distcp")
    for read in (
        lambda: inspect_report(step),
        lambda: convert(checkpoints.parent, tmp_path / "m.safetensors"),
        lambda: weight_source(str(checkpoints.parent)),
        lambda: weight_source(str(step)).tensors,
        lambda: plan_resume(checkpoints, "auto", False, 10, {}, ()),
    ):
        with pytest.raises(CheckpointError) as e:
            read()
        text = flat(str(e.value))
        assert f"checkpoint {step}: __0_0.distcp is damaged" in text
        assert f"Use the earlier checkpoint {checkpoints / 'step_000002'}" in text
    assert not (tmp_path / "m.safetensors").exists()
    open_tensors(checkpoints / "step_000002")  # the earlier one is intact


def test_checkpoint_without_checksums_is_read_but_resumed_only_when_told(checkpoints):
    step = checkpoints / "step_000004"
    assert not list(step.glob(".checksums_*"))  # the rank files were folded into meta.json
    meta = json.loads((step / META_FILE).read_text())
    del meta[CHECKSUMS]  # as freetx saved before it recorded them
    (step / META_FILE).write_text(json.dumps(meta))
    flip(step / "__0_0.distcp")  # unnoticed without checksums, as before
    assert "step_000004" in inspect_report(step)
    for resume in ("auto", str(step)):
        with pytest.raises(CheckpointError) as e:
            plan_resume(checkpoints, resume, False, 10, {}, ())
        text = flat(str(e.value))
        assert f"checkpoint {step} cannot be verified: its meta.json records no checksums" in text
        assert "resume with checkpoint.resume_unverified=true" in text
    plan = plan_resume(checkpoints, "auto", False, 10, {}, (), unverified=True)
    assert plan.step == 4 and "checkpoint.resume_unverified=true: resuming from" in plan.notices[0]


# -- the HF export --------------------------------------------------------------------------


def test_hf_export_does_not_follow_symbolic_links_of_the_source_folder(saved, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text('{"token": "s3cret"}')
    source = tmp_path / "hf_source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "generation_config.json").symlink_to(secret)
    (source / "tokenizer.json").symlink_to(secret)
    (source / "tokenizer_config.json").write_text("not json {")
    (source / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    out = tmp_path / "out"
    written = convert(saved / "step_000002", out, to="hf", hf_files_from=source)
    assert "s3cret" not in "".join(p.read_text(errors="ignore") for p in out.iterdir())
    assert not (out / "tokenizer.json").exists() and not (out / "tokenizer_config.json").exists()
    assert (out / "special_tokens_map.json").read_text() == '{"eos_token": "</s>"}'
    assert json.loads((out / "generation_config.json").read_text()) is not None
    notes = " ".join(written["notes"])
    assert "generation_config.json of" in notes and "is a symbolic link" in notes
    assert "tokenizer_config.json of" in notes and "is not valid JSON" in notes


def test_rerun_final_export_keeps_a_users_readme(saved, tmp_path):
    export_final(saved / "step_000002", tmp_path, "hf")
    folder = tmp_path / "export" / "hf"
    (folder / "README.md").write_text("my notes")
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # an export's name
    export_final(saved / "step_000004", tmp_path, "hf")
    assert (folder / "README.md").read_text() == "my notes"
    assert not (folder / "model-00001-of-00002.safetensors").exists()
    assert (folder / "model.safetensors").is_file()


def test_full_disk_during_final_export_says_training_and_checkpoint_are_complete(
    saved, tmp_path, monkeypatch
):
    export_final(saved / "step_000002", tmp_path, "hf")
    folder = tmp_path / "export" / "hf"
    (folder / "README.md").write_text("my notes")
    before = sorted(p.name for p in folder.iterdir())

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("freetx.checkpoint.formats.SafetensorsStreamWriter.write", full)
    step = saved / "step_000004"
    with pytest.raises(FreetxError) as e:
        export_final(step, tmp_path, "hf")
    text = flat(str(e.value))
    assert f"training finished, and its last checkpoint {step} is complete" in text
    assert "(No space left on device)" in text and "pick another path" not in text
    assert f"freetx checkpoint convert {step} {folder} --to hf --overwrite" in text
    assert sorted(p.name for p in folder.iterdir()) == before
