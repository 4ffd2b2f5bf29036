"""The example of docs/writing_a_recipe.md trains through the shared lifecycle, on 2
processes, through the CLI, and resumes like a built-in recipe."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, run_freetx, run_freetx_here

RECIPE = str(REPO / "docs" / "examples" / "two_spirals.py")
CONFIG = str(REPO / "docs" / "examples" / "two_spirals.yaml")


@pytest.mark.slow  # 20 s; make test stays under 12 min
def test_two_spirals_trains_and_resumes(tmp_path):
    assert run_freetx_here("validate", CONFIG, "--recipe", RECIPE).returncode == 0
    common = ["run", "--nproc-per-node", "2", RECIPE, "--config", CONFIG, f"output_dir={tmp_path}"]
    first = run_freetx(*common, "max_steps=100", "checkpoint.every_n_steps=50")
    assert first.returncode == 0, first.stderr
    second = run_freetx(*common, "max_steps=200", "checkpoint.every_n_steps=50")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "(step 100," in second.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["test/accuracy"] for r in records if "test/accuracy" in r]
    assert len(accuracy) == 2 and accuracy[-1] > 0.9  # chance is 0.5
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert losses[200] < losses[50] / 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "LATEST", "step_000150", "step_000200",
    ]  # fmt: skip
