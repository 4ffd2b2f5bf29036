"""ad_ddp through the CLI on 2 processes: histories once, training, the evaluation file."""

from __future__ import annotations

import json

import pytest

from tests.conftest import flat, run_freetx, run_freetx_here, run_refused_here

SMALL = [
    "max_steps=6", "log_every_n_steps=3", "batch_size=16", "histories.episodes=8",
    "histories.streams_per_goal=1", "model.n_transit=80", "eval.episodes=4", "eval.seeds=1",
    "checkpoint.every_n_steps=0", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
    "eval.temperatures=[0,1]",
]  # fmt: skip


@pytest.mark.slow  # 12 s: a launch, histories and the in-context evaluation
def test_short_run_writes_histories_metrics_and_the_evaluation_file(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "ad_ddp", "--config", "ad/darkroom_tiny",
        f"output_dir={tmp_path}", *SMALL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "generating Q-learning histories" in result.stdout
    (folder,) = (tmp_path / "data").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == [
        "metadata.json", "shard_00000.safetensors", "shard_00001.safetensors",
    ]  # fmt: skip
    evaluation = json.loads((tmp_path / "eval" / "in_context_returns.json").read_text())
    test, val = evaluation["test"], evaluation["validation"]
    assert len(test["returns_per_episode"]) == 4 and len(test["goals"]) == 8
    assert test["optimal_return"] == 17.0 and 0 < test["random_return"] < 1
    assert len(test["last5_per_goal"]) == 8
    assert [len(test["returns"]), len(test["returns"][0]), len(test["returns"][0][0])] == [8, 1, 4]
    # the temperature is the validation goals' choice; they are no test goal
    assert sorted(val["returns_per_episode"]) == ["0", "1"] and len(val["goals"]) == 8
    last5 = {t: sum(c[-5:]) / len(c[-5:]) for t, c in val["returns_per_episode"].items()}
    assert evaluation["temperature"] == float(max(last5, key=lambda t: (last5[t], -float(t))))
    assert not set(map(tuple, val["goals"])) & set(map(tuple, test["goals"]))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("action_accuracy" in r for r in records)
    assert any("eval/test_return_last5" in r for r in records)
    assert any("eval/val_return_last5_T0" in r for r in records)
    assert "validation: 8 goals" in result.stdout and "test: 8 held-out goals" in result.stdout

    # a second run (1 process, fresh output but the same data_dir) reuses the histories
    again = run_freetx(
        "run", "ad_ddp", "--config", "ad/darkroom_tiny", f"output_dir={tmp_path / 'b'}",
        f"data_dir={tmp_path / 'data'}", *SMALL,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "generating" not in again.stdout


@pytest.mark.parametrize(
    "override,message",
    [("model.n_transit=60", "fewer than 4 episodes"),
     ("env.grid_size=11", "Set model.num_states=121"),
     ("model.num_actions=4", "Set model.num_actions=5"),
     ("eval.seeds=0", "'eval.seeds' must be at least 1, got 0"),
     ("env.val_goals=0", "no validation goals to choose one on"),
     ("eval.temperatures=[]", "list one or more sampling temperatures"),
     ("env.val_goals=80", "env.val_goals < 73")],
)  # fmt: skip
def test_a_model_that_does_not_fit_the_environment_is_refused_by_validate(override, message):
    result = run_freetx_here("validate", "ad/darkroom_tiny", *SMALL, override)
    assert result.returncode == 1 and message in flat(result.stdout + result.stderr), result


def test_a_run_whose_model_does_not_fit_is_refused_before_any_history(tmp_path):
    """`freetx run` makes validate's checks before it launches (the recipe again in setup)."""
    result = run_refused_here(
        "ad_ddp", "--config", "ad/darkroom_tiny", f"output_dir={tmp_path}", *SMALL,
        "model.n_transit=60",
    )  # fmt: skip
    assert result.returncode == 1 and "fewer than 4 episodes" in flat(result.stderr), result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "data").exists()


@pytest.mark.slow  # 19 s; make test's budget
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    """6 steps straight == 3 steps, then resume=auto to 6: same windows, dropout masks,
    optimizer state (constant LR, so the schedule does not depend on max_steps)."""
    options = [
        *SMALL, f"data_dir={tmp_path / 'data'}", "log_every_n_steps=1", "model.dropout=0.1",
        "lr_schedule.warmup_steps=0", "lr_schedule.decay=constant",
    ]  # fmt: skip

    def train(output_dir, steps):
        result = run_freetx(
            "run", "--nproc-per-node", "2", "ad_ddp", "--config", "ad/darkroom_tiny",
            f"output_dir={output_dir}", *options, f"max_steps={steps}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
        return result, {r["step"]: r["loss"] for r in records if "loss" in r}

    _, straight = train(tmp_path / "straight", 6)
    train(tmp_path / "resumed", 3)
    result, resumed = train(tmp_path / "resumed", 6)
    assert "resumed from" in result.stdout and "(step 3," in result.stdout
    assert sorted(resumed) == list(range(1, 7))
    for step in range(4, 7):
        assert straight[step] == resumed[step], (step, straight[step], resumed[step])


@pytest.mark.parametrize(
    "config,override,message",
    [("ad/darkroom_compressed", "model.n_transit=80", "are 83 tokens with their markers"),
     ("ad/darkroom_compressed", "model.boundary_tokens=false", "only with model.boundary_tokens=true"),
     ("ad/darkroom_compressed", "compress.regions=1", "'compress.regions' must be at least 2"),
     ("ad/darkroom_compressed", "compress.region=1", "unknown key 'compress.region'"),
     ("ad/darkroom_compressed", "histories.episodes=3", "longer than a history (3 episodes"),
     ("ad/darkroom_tiny", "model.boundary_tokens=true", "there is no compress: section")],
)  # fmt: skip
def test_a_compressed_context_that_does_not_fit_is_refused_by_validate(config, override, message):
    result = run_freetx_here("validate", config, override)
    assert result.returncode == 1 and message in flat(result.stdout + result.stderr), result


@pytest.mark.slow  # 15 s: a launch, histories and the in-context evaluation
def test_compressed_ad_trains_and_evaluates_on_two_processes(tmp_path):
    """ad/darkroom_compressed: windows of 2 regions of 2 episodes between <compress> /
    </compress> markers (83 tokens), actions predicted at transitions only, the in-context
    runs laid out the same way (tests/unit/test_darkroom.py)."""
    result = run_freetx(
        "run", "--nproc-per-node", "2", "ad_ddp", "--config", "ad/darkroom_compressed",
        f"output_dir={tmp_path}", *[o for o in SMALL if not o.startswith("model.n_transit")],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "context compressed: 2 regions x 2 episodes" in result.stdout
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["action_accuracy"] for r in records if "action_accuracy" in r]
    assert accuracy and all(0 <= a <= 1 for a in accuracy)
    evaluation = json.loads((tmp_path / "eval" / "in_context_returns.json").read_text())
    assert len(evaluation["test"]["returns_per_episode"]) == 4
