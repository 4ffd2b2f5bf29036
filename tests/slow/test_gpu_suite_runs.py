"""`python benchmarks/gpu_suite.py --device cpu --tiny` end to end, as a GPU session's first
check: every workload at a tiny size of its shape's family builds, runs 2 steps and
reports (tests/unit/test_gpu_suite.py runs a few of them in make test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import gpu_suite
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # 14 runs, ~95 s


def test_every_workload_runs_at_a_tiny_size_on_the_cpu(tmp_path):
    script = REPO / "benchmarks" / "gpu_suite.py"
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--device",
                             "cpu", "--tiny"], capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [w.name for w in gpu_suite.WORKLOADS]
    for row in rows:
        assert row["tokens_per_s_per_device"] > 0 and row["peak_gib"] > 0, row
        assert row["estimate_gib"] > 0, row
    by_name = {r["name"]: r for r in rows}
    for workload in gpu_suite.WORKLOADS:
        if workload.vs:
            assert by_name[workload.name]["vs"].endswith(f"{workload.vs}'s step")
    assert 0 < by_name["grpo_llama1b"]["generation_share"] < 1
    assert "| moe_qwen3_30b_a3b_4l |" in (tmp_path / "results.md").read_text()
