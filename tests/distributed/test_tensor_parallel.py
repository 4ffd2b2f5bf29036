"""Tensor parallelism on 4 gloo processes, a (dp 2, tp 2) mesh: the same initial
weights, gradients and clipped update as 1 process on the whole batch, for a dense
decoder (tied and untied head) and an MoE one."""

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

TIGHT = 2e-6  # fp32: differences come only from the order of summation
CASES = [f"{model}/chunks{c}/accumulation{a}" for model in ("untied", "tied", "moe")
         for c, a in ((1, 1), (3, 2))]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    script = Path(__file__).with_name("tensor_parallel_checks.py")
    return run_checks(script, tmp_path_factory.mktemp("tensor_parallel"), nproc=4)


def test_ranks_form_a_dp_by_tp_mesh(results):
    """Ranks next to each other slice the same layers and read the same data."""
    axes = [rank["axes"] for rank in results]
    assert axes == [[0, 2, 0, 2], [0, 2, 1, 2], [1, 2, 0, 2], [1, 2, 1, 2]]


@pytest.mark.parametrize("case", CASES)
def test_sliced_layers_train_as_one_process(results, case):
    for rank in results:
        assert rank[f"{case}/init"] == 0.0  # initialized from the full tensors
        assert rank[f"{case}/grad"] < TIGHT
        assert rank[f"{case}/param"] < TIGHT
