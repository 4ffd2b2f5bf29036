"""benchmarks/gpu_suite.py before a GPU is lent: every workload at its real size is a config
a run accepts and fits one H200 by `freetx estimate`; at tiny sizes on the CPU the suite
runs workloads, reads their figures and writes its table, records a failing workload and
goes on, and stops starting workloads when its time is spent. Every workload at tiny size,
through the script's command line: tests/slow/test_gpu_suite_runs.py."""

from __future__ import annotations

import dataclasses
import json

from benchmarks import gpu_suite
from freetx.planning.estimate import DEVICES


def test_every_workload_at_its_real_size_fits_one_h200_by_the_estimate(tmp_path):
    room = 0.9 * DEVICES["h200"].memory_gib  # the allocator's caching on top
    for workload in gpu_suite.WORKLOADS:
        folder = gpu_suite.model_folder(workload, tmp_path, small=False)
        args = gpu_suite.arguments(workload, folder, tmp_path / workload.name, "cuda", False)
        cfg = gpu_suite.run_config(workload, args)
        layout, precision = gpu_suite.setup_of(cfg, "cuda")
        assert ("compile" in layout) == (gpu_suite.COMPILE in args) and "bf16" in precision
        assert ("NF4" in precision) == (workload.name == "qlora_llama8b")
        peak = gpu_suite.estimated_peak_gib(cfg, "h200")
        assert 1 < peak < room, (workload.name, peak)


def test_the_tiny_suite_reports_its_workloads_and_goes_on_past_a_failing_one(tmp_path, monkeypatch):
    broken = dataclasses.replace(
        gpu_suite.BY_NAME["sft_llama1b"], name="broken", tiny=("no_such_key=1",)
    )
    monkeypatch.setitem(gpu_suite.BY_NAME, "broken", broken)
    only = ["--only", "broken", "--only", "sft_llama1b"]  # every workload: the slow tier
    code = gpu_suite.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", *only])
    assert code == 1  # a workload failed
    rows = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert list(rows) == ["broken", "sft_llama1b"]
    assert "no_such_key" in rows["broken"]["error"]
    row = rows["sft_llama1b"]
    assert "error" not in row, row
    assert row["tokens_per_s_per_device"] > 0 and row["peak_gib"] > 0
    assert 0 < row["estimate_gib"] < row["peak_gib"]  # the CPU's RSS holds Python too
    assert "distributed.compile" not in row["command"]  # compile: a GPU's only
    logs = tmp_path / "logs"
    assert (logs / "sft_llama1b.log").is_file() and not (logs / "broken.log").exists()
    table = (tmp_path / "results.md").read_text()
    assert "| sft_llama1b | full_finetune_fsdp2 | Llama-3.2-1B (tiny) | 1 CPU process" in table
    assert "FAILED: " in table


def test_a_spent_budget_starts_nothing_more(tmp_path):
    code = gpu_suite.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--quick",
                           "--budget-s", "0"])  # fmt: skip
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert code == 1 and [r["name"] for r in rows] == [
        w.name for w in gpu_suite.quick_list(gpu_suite.WORKLOADS)
    ]
    assert all(r["error"].startswith("not run: the suite's --budget-s 0") for r in rows)
    assert not (tmp_path / "runs").exists()


def test_dpo_is_compared_with_the_sft_workload_of_its_positions():
    rows = [{"name": "lora_llama8b", "step_time_s": 2.0},
            {"name": "dpo_lora_llama8b", "step_time_s": 3.0}]  # fmt: skip
    gpu_suite.compare(rows)
    assert rows[1]["vs"] == "1.50x lora_llama8b's step" and "vs" not in rows[0]
