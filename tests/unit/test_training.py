"""LR schedules, loss normalization, metrics formatting."""

import pytest
import torch

from freetx.logging import format_value
from freetx.training import CrossEntropyLoss, LRScheduleConfig, lr_multiplier


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_then_decay(decay):
    cfg = LRScheduleConfig(warmup_steps=10, decay=decay, min_lr_ratio=0.1)
    values = [lr_multiplier(s, 110, cfg) for s in range(110)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    if decay == "constant":
        assert values[-1] == 1.0
    else:
        assert values[10] == pytest.approx(1.0)
        assert values[-1] == pytest.approx(0.1, abs=0.02)
        assert all(a >= b for a, b in zip(values[10:], values[11:]))
    if decay == "linear":
        assert values[60] == pytest.approx(0.55)


def test_cross_entropy_is_a_sum_over_unmasked_tokens():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, -100], [0, -100, -100]])
    loss, extra = CrossEntropyLoss()(logits, labels)
    per_token = torch.nn.functional.cross_entropy(
        logits.view(-1, 5), labels.view(-1), reduction="none"
    )
    assert torch.allclose(loss, per_token.sum()) and extra == {}


def test_format_value():
    assert format_value(2.34567) == "2.3457"
    assert format_value(12345.6) == "12,346"
    assert format_value(3e-4) == "3.00e-04"
    assert format_value(7) == "7"


def test_slurm_variables_become_torchrun_ones():
    from freetx.distributed.runtime import first_host, slurm_environment

    assert first_host("gpu[03-05,07],cpu1") == "gpu03"
    assert first_host("node7,node8") == "node7"
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
           "SLURM_JOB_NODELIST": "gpu[10-11]", "SLURM_NTASKS_PER_NODE": "4(x2)"}  # fmt: skip
    assert slurm_environment(env) == {
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu10", "MASTER_PORT": "21234",
    }  # fmt: skip
    assert slurm_environment({**env, "RANK": "0"}) == {}  # torchrun's win
    assert slurm_environment({}) == {}
