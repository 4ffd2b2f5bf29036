"""`dataset.packed=true` through the CLI: a packed instruction run on 2 processes trains
and validates; a model that cannot keep documents apart is refused before any work."""

from __future__ import annotations

import json

import pytest

from tests.conftest import flat, one_paragraph, run_freetx, run_freetx_here, run_refused_here

QUIET = ["metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]", "checkpoint.every_n_steps=0"]


@pytest.mark.slow  # 30 s on 2 shared cores
def test_a_packed_instruction_run_trains_and_validates_on_two_processes(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/instruct_tiny",
        f"output_dir={tmp_path}", "dataset.packed=true", "dataset.seq_len=128",
        "dataset.num_builtin_examples=2000", "max_steps=3", "log_every_n_steps=1",
        "batch_size=8", "eval.batch_size=8", "eval.max_batches=2", *QUIET,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses)
    assert any("val/loss" in r for r in records)


def test_a_packed_dataset_is_refused_for_the_free_transformer(tmp_path):
    result = run_refused_here(
        "full_finetune_fsdp2", "--config", "free_transformer/text_tiny",
        f"output_dir={tmp_path / 'run'}", "dataset.packed=true", "max_steps=2", *QUIET,
    )  # fmt: skip
    message = one_paragraph(result)
    assert "dataset.packed=true" in message and "FreeTransformer" in message
    assert "Set dataset.packed=false" in message
    assert not (tmp_path / "run").exists()  # refused before anything was launched
    # freetx validate names it too (its report on stdout)
    validated = run_freetx_here("validate", "free_transformer/text_tiny", "dataset.packed=true")
    assert validated.returncode == 1 and "Set dataset.packed=false" in flat(validated.stdout)
