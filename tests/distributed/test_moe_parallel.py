"""The MoE decoder on 2 gloo processes: one step's gradients equal one process's."""

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

TIGHT = 2e-6  # fp32: differences come only from the order of summation


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(Path(__file__).with_name("moe_checks.py"), tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "fsdp_ac"])
def test_moe_gradients_with_the_router_loss_match_one_process(results, strategy):
    for rank in results:
        assert rank[f"{strategy}/grad"] < TIGHT
        assert rank[f"{strategy}/router_grad"] > 0  # the routers train
        assert rank[f"{strategy}/aux_loss"] > 0
    assert results[0]["whole_batch/grad"] > 100 * TIGHT  # a comparison that can fail
