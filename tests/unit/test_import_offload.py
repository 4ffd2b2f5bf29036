"""`freetx import` maps DeepSpeed's two offloads to freetx's two keys separately:
`offload_optimizer` to `optimizer.offload: cpu` (ZeRO-Offload), `offload_param` to
`distributed.cpu_offload: true` (FSDP2's CPUOffloadPolicy, which steps the optimizer on
the CPU too), and says an NVMe device by name."""

from __future__ import annotations

import pytest

from tests.unit.test_config_import import imported

OPTIMIZER = {"offload_optimizer": {"device": "cpu"}}
PARAMETERS = {"offload_param": {"device": "cpu"}}


@pytest.mark.parametrize(
    "zero, overrides",
    [
        (OPTIMIZER, {"optimizer.offload": "cpu"}),
        (PARAMETERS, {"distributed.cpu_offload": True}),
        ({**OPTIMIZER, **PARAMETERS}, {"distributed.cpu_offload": True}),
        ({**PARAMETERS, **OPTIMIZER}, {"distributed.cpu_offload": True}),
        ({"offload_optimizer": {"device": "none"}}, {}),
    ],
    ids=["optimizer_only", "parameters_only", "both_optimizer_first", "both_parameters_first",
         "none"],
)  # fmt: skip
def test_deepspeed_offload_optimizer_and_offload_param_map_separately(tmp_path, zero, overrides):
    found = imported(tmp_path, "deepspeed", {"zero_optimization": {"stage": 2, **zero}})
    assert found.overrides == {"distributed.strategy": "zero2", **overrides}
    both = len(overrides) == 1 and len(zero) == 2
    assert any("taken in by distributed.cpu_offload" in n for n in found.notes) == both
    assert not any("ZeRO-Offload" in n for n in found.notes) or "optimizer.offload" in overrides


def test_deepspeed_nvme_offload_is_said_by_name(tmp_path):
    zero = {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}
    found = imported(tmp_path, "deepspeed", {"zero_optimization": zero})
    assert found.overrides == {}
    unmapped = dict(found.unmapped)
    for key in ("offload_optimizer", "offload_param"):
        assert "NVMe offload (ZeRO-Infinity)" in unmapped[f"zero_optimization.{key}.device"]
    assert "optimizer's states" in unmapped["zero_optimization.offload_optimizer.device"]


def test_accelerate_deepspeed_offload_devices_map_separately(tmp_path):
    data = {"distributed_type": "DEEPSPEED",
            "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "none",
                                 "offload_param_device": "cpu"}}  # fmt: skip
    found = imported(tmp_path, "accelerate", data, suffix=".yaml")
    assert found.overrides == {"distributed.strategy": "fsdp", "distributed.cpu_offload": True}
