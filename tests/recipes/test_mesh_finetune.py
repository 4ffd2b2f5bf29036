"""`distributed.tp` and `distributed.cp` through the CLI, on 4 processes: llm/tiny on
(dp 2, tp 2), (dp 2, cp 2) and (cp 2, tp 2) meshes repeats one process's losses step
by step; a checkpoint saved under one layout resumes under another and on one process;
packed data under cp 2 gives one process's losses; an impossible layout is refused in
one paragraph before any work."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import one_paragraph, run_freetx

QUIET = ["metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]", "log_every_n_steps=1",
         "dataset.seq_len=64", "batch_size=8", "eval.max_batches=1", "eval.batch_size=8"]  # fmt: skip
# llm/tiny_tp is llm/tiny at tp 2 (the twin of llm/llama3_70b_full's layout)
LAYOUTS = {"dp2_tp2": ["--config", "llm/tiny_tp"], "dp2_cp2": ["distributed.cp=2"],
           "cp2_tp2": ["distributed.cp=2", "distributed.tp=2"]}  # fmt: skip


def losses(output_dir, nproc: int, *overrides: str, config: str = "llm/tiny") -> dict[int, float]:
    """The losses by step of a run; `--config NAME` among `overrides` picks another config."""
    if "--config" in overrides:
        at = overrides.index("--config")
        config, overrides = overrides[at + 1], overrides[:at] + overrides[at + 2 :]
    result = run_freetx(
        "run", "--nproc-per-node", str(nproc), "full_finetune_fsdp2", "--config", config,
        f"output_dir={output_dir}", *QUIET, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_same(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return losses(out, 1, "max_steps=20", "checkpoint.every_n_steps=0")


@pytest.mark.slow  # a 20-step run of 4 processes per layout: ~25 s each on 2 cores
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_repeats_one_process(tmp_path, one_process, layout):
    got = losses(tmp_path, 4, "max_steps=20", "checkpoint.every_n_steps=0", *LAYOUTS[layout])
    assert got.keys() == one_process.keys() == set(range(1, 21))
    assert_same(got, one_process, range(1, 21))


@pytest.mark.slow  # three runs: ~1 minute on 2 cores
def test_a_save_resumes_under_another_layout_and_on_one_process(tmp_path, one_process):
    """Steps 1-10 on (dp 2, cp 2) (warm-up: the schedule does not depend on max_steps),
    then 11-20 from its checkpoint on (cp 2, tp 2), and on one process."""
    saved = tmp_path / "saved"
    losses(saved, 4, "max_steps=10", "checkpoint.every_n_steps=10", *LAYOUTS["dp2_cp2"])
    shutil.copytree(saved, tmp_path / "other")
    other = losses(tmp_path / "other", 4, "max_steps=20", "checkpoint.every_n_steps=0",
                   *LAYOUTS["cp2_tp2"])  # fmt: skip
    assert_same(other, one_process, range(1, 21))
    alone = losses(saved, 1, "max_steps=20", "checkpoint.every_n_steps=0")
    assert_same(alone, one_process, range(1, 21))


@pytest.mark.slow  # two runs of llm/tiny_cp: ~40 s on 2 cores
def test_packed_documents_under_cp_repeat_one_process(tmp_path):
    """llm/tiny_cp (the twin of llm/llama3_1_8b_128k: packed documents, dp 2 x cp 2,
    full activation checkpointing, the loss in 2 chunks) against itself at cp 1."""
    packed = ["max_steps=8", "checkpoint.every_n_steps=0"]
    one = losses(tmp_path / "one", 1, *packed, "distributed.cp=1", config="llm/tiny_cp")
    split = losses(tmp_path / "cp", 4, *packed, config="llm/tiny_cp")
    assert_same(split, one, range(1, 9))


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
