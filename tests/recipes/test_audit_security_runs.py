"""The audit's security and silently-wrong cases through `freetx run` (issue 36): a
component that runs a program is refused before anything trains; a real run records the
checksums of its files (asynchronous saves too), and a resume refuses a damaged `.distcp`
file and a planted `.metadata`, naming the earlier checkpoint, and a checkpoint without
checksums unless checkpoint.resume_unverified=true."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import flat, one_paragraph, run_freetx
from tests.unit.test_audit_security import OS_SYSTEM, flip, hostile_config, plant

pytestmark = pytest.mark.slow


def train(out, *more):
    result = run_freetx(
        "run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={out}",
        "checkpoint.every_n_steps=2", "eval.max_batches=1", "metric_loggers=[]", *more,
    )  # fmt: skip
    return result


def test_component_os_system_is_refused_by_run_before_training(tmp_path):
    config, marker = hostile_config(tmp_path, "dataset.cache_dir", OS_SYSTEM)
    result = run_freetx("run", "full_finetune_fsdp2", "--config", str(config))
    text = one_paragraph(result)
    assert "dataset.cache_dir._component_: 'os.system' is refused" in text
    assert not marker.exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("S") / "run"
    result = train(out, "max_steps=4", "checkpoint.async_save=true")
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def run(base_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


def test_a_run_records_the_checksum_of_every_file_it_saved(base_run):
    for step in ("step_000002", "step_000004"):
        folder = base_run / "checkpoints" / step
        recorded = json.loads((folder / "meta.json").read_text())["checksums"]["sha256"]
        files = sorted(p.name for p in folder.iterdir() if p.name != "meta.json")
        assert sorted(recorded) == files  # every .distcp and .metadata, no rank file left


def test_resume_on_flipped_distcp_bytes_is_refused_naming_the_earlier_checkpoint(run):
    flip(run / "checkpoints" / "step_000004" / "__0_1.distcp", at=100_000)
    text = one_paragraph(train(run, "max_steps=6"))
    assert f"checkpoint {run / 'checkpoints' / 'step_000004'}: __0_1.distcp is damaged" in text
    earlier = run / "checkpoints" / "step_000002"
    assert f"Use the earlier checkpoint {earlier}" in text
    resumed = train(run, "max_steps=6", f"resume={earlier}", "checkpoint.overwrite=true")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {earlier}" in flat(resumed.stdout)


def test_resume_of_a_checkpoint_without_checksums_is_refused_unless_told(run):
    step = run / "checkpoints" / "step_000004"
    meta = json.loads((step / "meta.json").read_text())
    del meta["checksums"]  # as freetx saved before it recorded them, or an edit
    (step / "meta.json").write_text(json.dumps(meta))
    text = one_paragraph(train(run, "max_steps=6"))
    assert f"checkpoint {step} cannot be verified: its meta.json records no checksums" in text
    assert "resume with checkpoint.resume_unverified=true" in text
    resumed = train(run, "max_steps=6", "checkpoint.resume_unverified=true")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {step}" in flat(resumed.stdout)
    saved = json.loads((run / "checkpoints" / "step_000006" / "meta.json").read_text())
    assert saved["checksums"]["sha256"]  # what the run saves is checksummed again


def test_resume_on_a_planted_metadata_runs_no_code(run, tmp_path):
    marker = plant(run / "checkpoints" / "step_000004", tmp_path)
    result = train(run, "max_steps=6")
    assert ".metadata is not a DCP metadata file (its pickle names posix.system)" in flat(
        result.stdout + result.stderr
    )
    assert not marker.exists()
