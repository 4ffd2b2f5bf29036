"""A dataset mixture through the CLI (llm/mixture_tiny: instructions and text at 3:1):
each source's loss is logged in training and validation, beside throughput that counts
real work, and a run resumed at another world size reads the same samples in the same
order, so its steps repeat the uninterrupted run's losses, source by source."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_freetx

QUIET = ["metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]", "log_every_n_steps=1",
         "eval.every_n_steps=0", "eval.max_batches=null", "dataset.num_samples=400",
         "batch_size=8", "lr_schedule.warmup_steps=1"]  # fmt: skip


def train(output_dir, nproc: int, *overrides: str) -> list[dict]:
    result = run_freetx(
        "run", "--nproc-per-node", str(nproc), "full_finetune_fsdp2", "--config",
        "llm/mixture_tiny", f"output_dir={output_dir}", *QUIET, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]


def steps(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "loss" in r}


@pytest.mark.slow  # three 2-process runs: ~40 s on 2 shared cores
def test_a_mixture_logs_each_source_and_resumes_at_another_world_size_in_order(tmp_path):
    whole = train(tmp_path / "whole", 2, "max_steps=4", "checkpoint.every_n_steps=0")
    logged = steps(whole)
    for record in logged.values():  # a source none of whose samples a step drew is left out
        assert all(0 < record[k] < 10 for k in ("loss/tasks", "loss/text") if k in record)
        assert record["loss_tokens_per_s"] > 0 and 0 < record["padding_fraction"] < 1
    for key in ("loss/tasks", "loss/text"):
        assert any(key in record for record in logged.values()), key
    validation = next(r for r in whole if "val/loss" in r)
    assert {"val/loss/tasks", "val/loss/text"} <= validation.keys()

    # 2 steps on 2 processes, then steps 3-4 on 1: the data order is the global step's
    train(tmp_path / "resumed", 2, "max_steps=2", "checkpoint.every_n_steps=2")
    resumed = steps(train(tmp_path / "resumed", 1, "max_steps=4", "checkpoint.every_n_steps=0"))
    for step in (3, 4):  # the same samples: the same sources logged, the same losses
        keys = {k for k in logged[step] if k == "loss" or k.startswith("loss/")}
        assert keys == {k for k in resumed[step] if k == "loss" or k.startswith("loss/")}
        for key in keys:
            assert resumed[step][key] == pytest.approx(logged[step][key], rel=1e-4), (step, key)
