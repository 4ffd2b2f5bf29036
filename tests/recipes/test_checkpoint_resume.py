"""Checkpoints through the CLI on 2 processes: exact resume, faults, resharding."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from freetx.checkpoint import convert, step_name
from tests.conftest import ASSETS, flat, run_freetx

# constant LR after a 2-step warmup: the schedule does not depend on max_steps,
# so a run stopped at step 4 and resumed to 8 sees the same LRs as a straight one
COMMON = [
    "log_every_n_steps=1", "lr_schedule.warmup_steps=2", "lr_schedule.decay=constant",
    "eval.max_batches=1", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
]  # fmt: skip


def losses(output_dir) -> dict[int, float]:
    out = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def train(output_dir, *overrides, nproc=2, env=None, expect=0):
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    result = run_freetx(
        "run", *launch, "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={output_dir}", *COMMON, *overrides, env=env,
    )  # fmt: skip
    assert result.returncode == expect, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
    """Losses of uninterrupted 8-step runs, made once per (strategy, dropout)."""
    cache: dict[tuple[str, float], dict[int, float]] = {}

    def get(strategy: str, dropout: float) -> dict[int, float]:
        if (strategy, dropout) not in cache:
            out = tmp_path_factory.mktemp(f"straight_{strategy}_{dropout}")
            train(
                out, "max_steps=8", f"distributed.strategy={strategy}", f"model.dropout={dropout}"
            )
            cache[(strategy, dropout)] = losses(out)
        return cache[(strategy, dropout)]

    return get


@pytest.mark.parametrize(
    "strategy,extra",
    [
        pytest.param("fsdp", [], marks=pytest.mark.slow),  # 25 s; the fast tier: test_saved_work
        pytest.param("ddp", [], marks=pytest.mark.slow),
        pytest.param("fsdp", ["checkpoint.async_save=true"], marks=pytest.mark.slow),
    ],
    ids=["fsdp", "ddp", "fsdp-async"],
)
def test_resume_reproduces_the_uninterrupted_run_exactly(
    tmp_path, straight_losses, strategy, extra
):
    options = [f"distributed.strategy={strategy}", "model.dropout=0.1", *extra]
    resumed = tmp_path / "resumed"
    train(resumed, "max_steps=4", *options)
    assert (resumed / "checkpoints" / "LATEST").read_text().strip() == "step_000004"
    result = train(resumed, "max_steps=8", *options)
    assert "resumed from" in result.stdout and "(step 4," in result.stdout
    a, b = straight_losses(strategy, 0.1), losses(resumed)
    assert sorted(b) == list(range(1, 9))
    for step in range(5, 9):  # exact: same data, same dropout masks, same optimizer state
        assert a[step] == b[step], (step, a[step], b[step])


@pytest.mark.slow  # ~15-20 s of 2-process runs: make test's 12 minutes
def test_resume_at_another_world_size_and_strategy(tmp_path, straight_losses):
    resumed = tmp_path / "resumed"
    train(resumed, "max_steps=4")
    # 1 process, twice the accumulation: the same global batches in the same order
    result = train(resumed, "max_steps=8", "gradient_accumulation_steps=2",
                   "distributed.strategy=ddp", nproc=1)  # fmt: skip
    assert "saved at world size 2 with fsdp" in result.stdout
    a, b = straight_losses("fsdp", 0.0), losses(resumed)
    for step in range(5, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-4), step


def scaler_state(output_dir, step: int) -> tuple[float, int]:
    """The loss scale and growth tracker a checkpoint holds (read as `freetx checkpoint
    convert` to .pt reads them)."""
    full = output_dir / f"full_{step}.pt"
    convert(output_dir / "checkpoints" / step_name(step), full)
    state = torch.load(full, weights_only=True)
    return state["scaler.scale"], state["scaler._growth_tracker"]


FLOAT16 = "distributed.mixed_precision.param_dtype=float16"


@pytest.mark.slow  # 20 s: two 2-process runs
def test_float16_with_fsdp_saves_and_resumes_its_loss_scale(tmp_path):
    """float16 on a sharded strategy (the scaler agreed over the ranks): its checkpoints
    hold the loss scale and its growth tracker (one per step without an Inf), and a
    resume continues them. The resumed run ends with `checkpoint.final_export`."""
    out = tmp_path / "fp16"
    result = train(out, "max_steps=2", FLOAT16)
    assert "strategy fsdp" in result.stdout and "precision param float16" in result.stdout
    assert scaler_state(out, 2) == (65536.0, 2)
    result = train(out, "max_steps=4", FLOAT16, "checkpoint.final_export=safetensors")
    assert scaler_state(out, 4) == (65536.0, 4)  # restored: 2 more, not 2 afresh
    assert sorted(losses(out)) == list(range(1, 5))
    assert all(math.isfinite(loss) for loss in losses(out).values())
    # the final export: what `freetx checkpoint convert` writes from the last checkpoint
    exported = out / "export" / "safetensors" / "model.safetensors"
    assert f"to {exported}" in result.stdout
    convert(out / "checkpoints" / step_name(4), tmp_path / "converted.safetensors")
    assert exported.read_bytes() == (tmp_path / "converted.safetensors").read_bytes()


@pytest.mark.slow
def test_float16_resume_of_a_float32_checkpoint_starts_the_scaler_afresh(tmp_path):
    out = tmp_path / "fp32_then_fp16"
    train(out, "max_steps=2")  # float32: the checkpoint holds no scaler
    result = train(out, "max_steps=4", FLOAT16)
    assert "(step 2," in result.stdout
    assert scaler_state(out, 4) == (65536.0, 2)  # two steps since the scaler started


@pytest.mark.slow  # ~15-20 s of 2-process runs: make test's 12 minutes
def test_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path, straight_losses):
    run_dir = tmp_path / "run"
    env = {
        "PYTHONPATH": os.pathsep.join(
            [str(ASSETS / "fault_injection"), os.environ.get("PYTHONPATH", "")]
        ),
        "FREETX_TEST_KILL_SAVE": "step_000004",
    }
    result = train(run_dir, "max_steps=6", "checkpoint.every_n_steps=2", env=env, expect=1)
    assert "rank 1 exited with code 1 without a message" in result.stderr
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "step_000002"
    assert not (checkpoints / "step_000004").exists()
    assert (checkpoints / "step_000002" / ".metadata").is_file()

    result = train(run_dir, "max_steps=6", "checkpoint.every_n_steps=2")
    assert "(step 2," in result.stdout
    assert not list(checkpoints.glob(".tmp_*"))
    assert (checkpoints / "LATEST").read_text().strip() == "step_000006"
    a, b = straight_losses("fsdp", 0.0), losses(run_dir)  # constant LR: 8 steps or 6 alike
    for step in range(3, 7):
        assert a[step] == b[step]


def test_keep_last_prunes_older_checkpoints_and_the_log_times_saves_apart(tmp_path):
    train(tmp_path, "max_steps=4", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2",
          "eval.every_n_steps=2", nproc=1)  # fmt: skip
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["LATEST", "step_000003", "step_000004"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "loss" in r}  # a step's time is the step's alone
    assert "time/checkpoint" not in steps[1] and steps[2]["time/checkpoint"] > 0
    assert "time/eval" not in steps[2] and steps[3]["time/eval"] > 0  # the eval after step 2


def test_failed_save_keeps_earlier_checkpoints_and_says_why(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / ".tmp_step_000002").write_text("a file where the save's folder must go")
    result = train(tmp_path, "max_steps=3", "checkpoint.every_n_steps=1", nproc=1, expect=1)
    assert "saving checkpoint step_000002" in flat(result.stderr)
    assert "Earlier checkpoints are untouched (latest: step_000001)" in flat(result.stderr)
    assert "Traceback" not in result.stderr
    assert (checkpoints / "LATEST").read_text().strip() == "step_000001"
    assert (checkpoints / "step_000001" / ".metadata").is_file()


@pytest.mark.slow  # 9 s: two runs
def test_checkpoint_of_another_model_lists_the_mismatch(tmp_path):
    # (a resume with another model shape is refused earlier, by the settings it was
    # saved with: tests/recipes/test_saved_work.py)
    train(tmp_path / "a", "max_steps=1", nproc=1)
    ckpt = tmp_path / "a" / "checkpoints" / "step_000001"
    result = train(tmp_path / "b", "max_steps=2", "model.vocab_size=300",
                   f"checkpoint.initial_weights={ckpt}", nproc=1, expect=1)  # fmt: skip
    assert "do not fit this model" in flat(result.stderr)
    assert (
        "shape of tok_embeddings.weight: model [300, 192], checkpoint [259, 192]" in result.stderr
    )
    assert "Traceback" not in result.stderr


def test_resume_never_refuses_to_overwrite_checkpoints(tmp_path):
    train(tmp_path, "max_steps=1", nproc=1)
    result = train(tmp_path, "max_steps=2", "resume=never", nproc=1, expect=1)
    assert "already holds checkpoints" in flat(result.stderr)


def test_resume_from_a_missing_path_is_an_error(tmp_path):
    result = train(tmp_path, "max_steps=2", f"resume={tmp_path / 'nope'}", nproc=1, expect=1)
    assert "does not exist" in flat(result.stderr) and "Traceback" not in result.stderr
