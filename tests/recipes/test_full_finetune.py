"""full_finetune_fsdp2 through the real CLI: training works, bad input fails early."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.conftest import flat, run_freetx, run_freetx_here, run_refused_here


def read_metrics(output_dir):
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_llm_tiny_two_processes_loss_falls(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={tmp_path}", "max_steps=30", "log_every_n_steps=5",
        "eval.every_n_steps=0", "eval.max_batches=4", "~metric_loggers[2]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "world size 2 | strategy fsdp" in result.stdout
    records = read_metrics(tmp_path)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # from ~4.3 to ~3.0 nats per byte
    final = records[-1]
    assert final["step"] == 30 and final["val/loss"] < train[0]["loss"]
    for key in ("lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "memory/max_rss_gib"):
        assert key in train[-1]
    assert (tmp_path / "config.yaml").exists()


def test_float16_with_fsdp_on_two_processes_rides_out_an_overflow(tmp_path):
    """float16 on fsdp (a batch of 4 overflows at step 2 on the CPU, with the windows
    dataset.seed=1 puts in training): the scaler skips the update on both ranks and halves
    the scale, which `on_nonfinite: stop` does not count as a failure; training goes on."""
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={tmp_path}", "max_steps=3", "log_every_n_steps=1", "eval.max_batches=1",
        "batch_size=4", "dataset.seq_len=32", "dataset.seed=1", "eval.batch_size=4", "on_nonfinite=stop",
        "distributed.mixed_precision.param_dtype=float16", "~metric_loggers[2]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "strategy fsdp" in result.stdout and "precision param float16" in result.stdout
    # inf, or nan where an overflowed float16 gradient met another (inf - inf) in backward
    assert re.search(
        r"step 2: the gradient norm is (inf|nan); float16 overflow, the loss scale is now 32768",
        result.stdout,
    )
    train = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert not math.isfinite(train[1]["grad_norm"]) and train[2]["grad_norm"] < 100


BAD_INPUTS = [  # refused by `freetx run` before it launches: tried in this process
    (["distributed.strategy=hsdp", "distributed.replicate_degree=3"], "does not divide"),
    (["distributed.cpu_offload=true"], "needs an accelerator"),
    (["batch_size=10", "gradient_accumulation_steps=3"], "cannot be split"),
    (["max_stpes=10"], "did you mean 'max_steps'"),
]
BAD_INPUTS_THE_RECIPE_SEES = [  # refused by the recipe's setup, before its first step
    (["dataset.seq_len=512"], "longer than the model's max_seq_len"),
    (["model.vocab_size=100"], "the tokenizer has 259 tokens"),
]


@pytest.mark.parametrize(
    "overrides,fragment,refused_by",
    [(*case, "cli") for case in BAD_INPUTS] + [(*case, "recipe") for case in BAD_INPUTS_THE_RECIPE_SEES],
)  # fmt: skip
def test_bad_input_is_one_paragraph_before_training(tmp_path, overrides, fragment, refused_by):
    args = ["full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path}", *overrides]
    result = run_refused_here(*args) if refused_by == "cli" else run_freetx("run", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert fragment in flat(result.stderr)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()  # no training step happened


@pytest.mark.parametrize(
    "overrides,fragment",
    [(["distributed.strategy=fsdq"], "'distributed.strategy' must be one of"),
     (["dataset.source=/no/such/file.txt"], "does not exist"),
     (["optimizer.lrr=0.1"], "did you mean 'lr'")],
)  # fmt: skip
def test_bad_input_that_the_config_alone_shows_is_refused_by_validate(overrides, fragment):
    """What `freetx run` reads with the same checks (load_and_check) before it launches:
    validate names it too, in this process (the run's path: BAD_INPUTS above)."""
    result = run_freetx_here("validate", "llm/tiny", *overrides)
    assert result.returncode == 1 and fragment in flat(result.stdout + result.stderr)


def test_empty_data_file_is_an_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    result = run_freetx(
        "run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path / 'run'}",
        f"dataset.source={empty}",
    )  # fmt: skip
    assert result.returncode == 1 and "holds no text" in flat(result.stderr)


@pytest.mark.slow  # 8 s; make test's budget
def test_torchao_low_bit_adamw_through_the_config(tmp_path):
    result = run_freetx(
        "run", "full_finetune_fsdp2", "--config", "llm/tiny", f"output_dir={tmp_path}",
        "max_steps=3", "log_every_n_steps=1", "eval.max_batches=1", "~optimizer.betas",
        "optimizer._component_=torchao.optim.AdamW8bit",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    train = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert isinstance(train[-1]["lr"], float) and train[-1]["loss"] < train[0]["loss"]


@pytest.mark.slow  # 9 s; make test's budget
def test_the_profiler_section_writes_a_chrome_trace_per_rank(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={tmp_path}", "max_steps=5", "eval.every_n_steps=0", "metric_loggers=[]",
        "profiler.enabled=true", "profiler.wait=1", "profiler.warmup=1", "profiler.active=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        trace = json.loads((tmp_path / "profile" / f"rank{rank}_step4.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        assert "aten::mm" in names and any("all_gather" in n for n in names)
        assert "Self CPU" in (tmp_path / "profile" / f"rank{rank}_step4_ops.txt").read_text()


@pytest.mark.slow  # 11 s; make test's budget
def test_a_validation_figure_means_the_same_samples_at_any_world_size(tmp_path):
    """eval.batch_size and eval.max_batches count over all ranks: the same weights (lr 0:
    the seed's initial ones) score the same on 1 process and on 2."""
    scores = {}
    for nproc in ("1", "2"):
        out = tmp_path / nproc
        result = run_freetx(
            "run", "--nproc-per-node", nproc, "full_finetune_fsdp2", "--config", "llm/tiny",
            f"output_dir={out}", "max_steps=1", "optimizer.lr=0", "eval.batch_size=8",
            "eval.max_batches=3", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        scores[nproc] = read_metrics(out)[-1]["val/loss"]
    assert scores["1"] == pytest.approx(scores["2"], rel=1e-6)
