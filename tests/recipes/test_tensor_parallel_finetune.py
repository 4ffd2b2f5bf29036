"""`distributed.tp` through the CLI: llm/tiny on a (dp 2, tp 2) mesh of 4 processes
repeats one process's losses step by step, and its checkpoint resumes on one process;
an impossible layout is refused in one paragraph before any work."""

from __future__ import annotations

import json

import pytest

from tests.conftest import one_paragraph, run_freetx

QUIET = ["metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]", "log_every_n_steps=1",
         "dataset.seq_len=64", "batch_size=8", "eval.max_batches=1", "eval.batch_size=8"]  # fmt: skip


def losses(output_dir, nproc: int, *overrides: str) -> dict[int, float]:
    result = run_freetx(
        "run", "--nproc-per-node", str(nproc), "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={output_dir}", *QUIET, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow  # four runs, two of 4 processes: ~1 minute on 2 cores
def test_dp_by_tp_repeats_one_process_and_resumes_on_one(tmp_path):
    one = losses(tmp_path / "one", 1, "max_steps=20", "checkpoint.every_n_steps=0")
    sliced = losses(tmp_path / "tp", 4, "max_steps=20", "checkpoint.every_n_steps=0",
                    "distributed.tp=2")  # fmt: skip
    assert sliced.keys() == one.keys() == set(range(1, 21))
    for step, loss in one.items():
        assert abs(sliced[step] - loss) <= 1e-5, (step, sliced[step], loss)
    # 10 steps on the (dp, tp) mesh, then 10 more on one process from its checkpoint
    losses(tmp_path / "resumed", 4, "max_steps=10", "checkpoint.every_n_steps=10",
           "distributed.tp=2")  # fmt: skip
    resumed = losses(tmp_path / "resumed", 1, "max_steps=20", "checkpoint.every_n_steps=0")
    for step in range(11, 21):
        assert abs(resumed[step] - one[step]) <= 1e-5, (step, resumed[step], one[step])


@pytest.mark.slow  # a 4-process launch: make test's budget
def test_heads_that_tp_does_not_divide_are_refused_before_training(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "4", "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={tmp_path / 'run'}", "distributed.tp=4", "max_steps=2", *QUIET,
    )  # fmt: skip
    message = one_paragraph(result)
    assert "tp=4 does not divide the model's 6 attention heads and 2 key/value heads" in message
    assert "Pick a tp that divides both" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
