"""No folder taken over (docs/checkpoints.md#the-run-folder): a run writes into output_dir
only when it is missing, empty or a freetx run folder; never a parent of the current folder
or of the config, never over the config it was given; refused before anything is written,
by `validate` and `run` alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetx.checkpoint.run_folder import RECIPE_FILE, check_output_dir
from freetx.errors import CheckpointError
from tests.conftest import flat, one_paragraph, run_freetx_here, run_refused_here

USERS_CONFIG = "# my own notes\nmax_steps: 3  # keep it short\n"


def refused(folder, config=None) -> str:
    with pytest.raises(CheckpointError) as error:
        check_output_dir(folder, config)
    return flat(str(error.value))


def test_a_folder_holding_other_files_is_refused_naming_them(tmp_path):
    (tmp_path / "config.yaml").write_text(USERS_CONFIG)
    (tmp_path / "notes.txt").write_text("mine")
    text = refused(tmp_path)
    assert f"output_dir={tmp_path} is a folder holding files that are not a freetx run's" in text
    assert "(config.yaml, notes.txt)" in text and f"output_dir={tmp_path / 'run'}" in text


def test_missing_empty_and_run_folders_are_taken(tmp_path):
    check_output_dir(tmp_path / "new")
    check_output_dir(tmp_path)  # empty
    run = tmp_path / "run"
    run.mkdir()
    (run / RECIPE_FILE).write_text(json.dumps({"recipe": "full_finetune_fsdp2"}))
    (run / "config.yaml").write_text("max_steps: 3\n")
    check_output_dir(run)
    old = tmp_path / "old_run"  # a freetx older than recipe.json: its checkpoints say so
    (old / "checkpoints" / "step_000002").mkdir(parents=True)
    (old / "checkpoints" / "step_000002" / "meta.json").write_text("{}")
    (old / "metrics.jsonl").write_text("")
    check_output_dir(old)


def test_parents_roots_and_the_home_folder_are_refused(tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert "a parent of the current folder" in refused("../..")
    assert "the filesystem root" in refused("/")
    assert "your home folder" in refused(Path.home())
    config = tmp_path / "configs" / "sub" / "my.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(USERS_CONFIG)
    assert f"a parent of the config {config}" in refused(tmp_path / "configs", config)


def test_the_config_given_is_never_written(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / RECIPE_FILE).write_text(json.dumps({"recipe": "full_finetune_fsdp2"}))
    (run / "config.yaml").write_text("max_steps: 3\n")
    text = refused(run, run / "config.yaml")
    assert "holds the config this run was given" in text and "cp " in text


def test_validate_refuses_output_dir_dot_beside_the_users_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(USERS_CONFIG)
    result = run_freetx_here("validate", "llm/tiny", "output_dir=.")
    text = flat(result.stdout + result.stderr)
    assert result.returncode == 1 and "output_dir=. is a folder holding files" in text
    assert (tmp_path / "config.yaml").read_text() == USERS_CONFIG
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_run_writes_nothing_into_a_folder_it_would_take_over(tmp_path, monkeypatch):
    (tmp_path / "config.yaml").write_text(USERS_CONFIG)
    monkeypatch.chdir(tmp_path)
    text = one_paragraph(
        run_refused_here(
            "full_finetune_fsdp2", "--config", "llm/tiny", "output_dir=.", "max_steps=1"
        )
    )
    assert "output_dir=. is a folder holding files that are not a freetx run's" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert (tmp_path / "config.yaml").read_text() == USERS_CONFIG
