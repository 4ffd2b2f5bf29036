"""Expert parallelism on 4 gloo processes: one step's gradients of the MoE decoder equal
one process's under (ep 2 x dp 2), (ep 4) and (ep 2 x tp 2), each rank holding
E / ep experts."""

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

TIGHT = 2e-6  # fp32: differences come only from the order of summation


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    script = Path(__file__).with_name("expert_parallel_checks.py")
    return run_checks(script, tmp_path_factory.mktemp("expert_parallel"), 4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2_dp2", "ep4", "ep2_tp2"])
def test_expert_parallel_gradients_match_one_process(results, layout):
    experts = {"ep2_dp2": 2, "ep4": 1, "ep2_tp2": 2}[layout]  # 4 experts / ep
    for rank in results:
        assert rank[f"{layout}/grad"] < TIGHT
        assert rank[f"{layout}/experts_per_rank"] == experts
        assert rank[f"{layout}/expert_grad"] > 0  # the experts train
        assert rank[f"{layout}/aux_loss"] > 0  # with the router loss
