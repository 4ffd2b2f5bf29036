"""The optimizer's memory rungs on 2 gloo processes (optimizer_checks.py): every strategy
trains with `optimizer.offload: cpu` (and, where it works, `in_backward: true`) to the
ordinary optimizer's losses and weights (<= 1e-6, fp32); a checkpoint saved with a rung
resumes without it and the other way round; torchao's low-bit AdamW is sharded by FSDP2
and resumes exactly."""

from pathlib import Path

import pytest

from tests.distributed.launcher import run_checks

pytestmark = pytest.mark.slow  # one launch of ~30 s, and torchao's compiled steps (~60 s)
LOW_BIT = ["torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit", "torchao.optim.AdamWFp8"]
EXACT = 1e-6  # fp32: only the order of a norm's summation differs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    script = Path(__file__).with_name("optimizer_checks.py")
    return run_checks(script, tmp_path_factory.mktemp("rungs"), 2, *LOW_BIT)


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "hsdp2", "ddp", "zero1", "tp2"])
def test_offload_trains_as_the_ordinary_optimizer(results, strategy):
    for rank in results:
        assert rank[f"offload/{strategy}/loss"] <= EXACT
        assert rank[f"offload/{strategy}/param"] <= EXACT


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_offload_after_gradient_accumulation_trains_as_the_ordinary_optimizer(results, strategy):
    for rank in results:
        assert rank[f"offload/{strategy}/accumulation/loss"] <= EXACT
        assert rank[f"offload/{strategy}/accumulation/param"] <= EXACT


@pytest.mark.parametrize("strategy", ["fsdp", "zero2", "hsdp2", "tp2", "lora"])
def test_in_backward_per_sharded_parameter_trains_as_the_ordinary_optimizer(results, strategy):
    for rank in results:
        assert rank[f"in_backward/{strategy}/loss"] <= EXACT
        assert rank[f"in_backward/{strategy}/param"] <= EXACT


def test_offload_of_lora_adapters_trains_as_the_ordinary_optimizer(results):
    assert results[0]["offload/lora/loss"] <= EXACT


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_bfloat16_states_train_within_their_rounding(results, strategy):
    # three AdamW steps at lr 1e-2: the moments' stochastic rounding moves the weights by
    # ~2e-4 (bfloat16 keeps 8 bits of mantissa); 0 would mean the rung did nothing
    assert 0 < results[0][f"bf16_states/{strategy}/param"] < 1e-3


@pytest.mark.parametrize(
    "switch",
    ["plain_to_offload", "offload_to_plain", "in_backward_to_plain", "plain_to_in_backward",
     "offload_to_plain/ddp"],
)  # fmt: skip
def test_a_checkpoint_resumes_with_the_rung_switched(results, switch):
    for rank in results:
        assert rank[f"switch/{switch}/loss"] <= EXACT


@pytest.mark.parametrize("name", [c.rpartition(".")[2] for c in LOW_BIT])
def test_torchao_low_bit_adamw_is_sharded_and_resumes_exactly(results, name):
    for rank in results:
        assert rank[f"low_bit/{name}/resume/loss"] == 0.0


def test_torchao_8bit_adamw_offloaded_resumes_exactly(results):
    for rank in results:
        assert rank["low_bit/AdamW8bit/offload_resume/loss"] == 0.0
