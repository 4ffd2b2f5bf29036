"""The optimizer's memory rungs on one process (freetx.distributed.optimizer): offload,
in_backward and state_dtype train as the ordinary optimizer does; the checkpoint's view
has the ordinary shape; what a rung cannot combine with is refused with the fix.
(2 processes, every strategy, checkpoints switched: tests/distributed/test_optimizer_rungs.py)"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from freetx.distributed import DistributedConfig, Processes
from freetx.distributed.optimizer import (
    OffloadedOptimizer,
    PerParameterOptimizer,
    build_optimizer,
    check_optimizer,
)
from freetx.errors import ConfigError
from freetx.training.grad import clip_grad_norm


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def node(**rungs):
    cfg = {"_component_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.1, **rungs}
    return OmegaConf.create({"optimizer": cfg}).optimizer


def train(rungs: dict, steps: int = 5, clip: float | None = None, accumulation: int = 1):
    """The recipe's loop on a tiny model: losses and norms per step, the model, optimizer."""
    m = model()
    optimizer = build_optimizer(node(**rungs), m, {id(p): n for n, p in m.named_parameters()},
                                replicated=False)  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    history = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(accumulation):
            if isinstance(optimizer, OffloadedOptimizer):  # ParallelPlan.gradient_sync's
                optimizer.copy_gradients(i == accumulation - 1)
            loss = m(torch.randn(4, 8, generator=g)).pow(2).mean() / accumulation
            loss.backward()
            total += loss.item()
        norm = clip_grad_norm(m, clip, None, optimizer)
        optimizer.step()
        schedule.step()
        history.append((total, norm))
    return history, m, optimizer


def close(a, b) -> float:
    return max(max(abs(x[0] - y[0]), abs(x[1] - y[1])) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "rungs,clip,accumulation",
    [
        ({"offload": "cpu"}, None, 1),
        ({"offload": "cpu"}, 0.05, 1),
        ({"offload": "cpu"}, 0.05, 3),
        ({"in_backward": True}, None, 1),
        ({"state_dtype": "float32"}, 0.05, 2),
    ],
    ids=["offload", "offload-clipped", "offload-accumulated", "in_backward", "fp32-states"],
)
def test_a_rung_trains_to_the_ordinary_optimizers_losses(rungs, clip, accumulation):
    reference, ref_model, _ = train({}, clip=clip, accumulation=accumulation)
    history, trained, _ = train(rungs, clip=clip, accumulation=accumulation)
    assert close(history, reference) <= 1e-6
    for a, b in zip(trained.parameters(), ref_model.parameters()):
        assert (a - b).abs().max() <= 1e-6


def test_bfloat16_states_are_stored_in_bfloat16_and_train_within_their_rounding():
    reference, _, _ = train({}, steps=20)
    history, _, optimizer = train({"state_dtype": "bfloat16"}, steps=20)
    states = [s for o in optimizer.steps.optimizers for s in o.state.values()]
    assert {s["exp_avg"].dtype for s in states} == {torch.bfloat16}
    assert {s["exp_avg_sq"].dtype for s in states} == {torch.bfloat16}
    # stochastic rounding of the moments (8 bits of mantissa): the loss curve stays within
    # 1% of fp32's; what it loses is measured in benchmarks/memory_ladder.py
    assert max(abs(a[0] - b[0]) / b[0] for a, b in zip(history, reference)) < 0.01


def test_in_backward_frees_each_gradient_as_it_steps():
    _, m, optimizer = train({"in_backward": True}, steps=1)
    assert isinstance(optimizer, PerParameterOptimizer)
    assert all(p.grad is None for p in m.parameters())  # before zero_grad: already gone


def test_offload_keeps_an_fp32_host_copy_and_frees_the_device_gradients():
    _, m, optimizer = train({"offload": "cpu"}, steps=2)
    for host, p in zip(optimizer.hosts, m.parameters()):
        assert host.dtype == torch.float32 and torch.equal(host, p)
        assert p.grad is None


@pytest.mark.parametrize("rungs", [{"offload": "cpu"}, {"in_backward": True},
                                   {"state_dtype": "bfloat16"}])  # fmt: skip
def test_the_checkpoint_holds_the_ordinary_optimizers_state_shape(rungs):
    _, ref_model, ordinary = train({}, steps=1)
    _, m, optimizer = train(rungs, steps=1)
    mine, theirs = optimizer.named_state_dict(), get_optimizer_state_dict(ref_model, ordinary)
    assert set(mine["state"]) == set(theirs["state"])
    for name, state in theirs["state"].items():
        assert set(mine["state"][name]) == set(state)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in theirs["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in mine["param_groups"]] == strip
    assert [g["params"] for g in mine["param_groups"]] == [
        g["params"] for g in theirs["param_groups"]
    ]


def refusal(rungs: dict, accumulation=1, max_grad_norm=None, world=2, **dist) -> str:
    with pytest.raises(ConfigError) as e:
        check_optimizer(node(**rungs), DistributedConfig(**dist), Processes(world, world, "cpu"),
                        accumulation, max_grad_norm)  # fmt: skip
    return " ".join(e.value.problems + ([e.value.fix] if e.value.fix else []))


def test_in_backward_with_gradient_accumulation_is_refused_with_the_fix():
    text = refusal({"in_backward": True}, accumulation=4)
    assert "gradient_accumulation_steps=4" in text and "gradient_accumulation_steps=1" in text


def test_in_backward_with_clipping_is_refused_with_the_fix():
    text = refusal({"in_backward": True}, max_grad_norm=1.0)
    assert "max_grad_norm=1.0" in text and "max_grad_norm=null" in text


def test_in_backward_under_ddp_on_two_processes_is_refused_with_the_fix():
    assert "strategy=fsdp" in refusal({"in_backward": True}, strategy="ddp")
    check_optimizer(
        node(in_backward=True), DistributedConfig(strategy="ddp"), Processes(1, 1, "cpu"), 1, None
    )  # fmt: skip - one process: no all-reduce


def test_offload_and_in_backward_together_are_refused():
    assert "Set one of them" in refusal({"in_backward": True, "offload": "cpu"})


def test_a_rung_under_pipeline_parallelism_is_refused():
    assert "distributed.pp=1" in refusal({"offload": "cpu"}, pp=2)


def test_a_rung_with_float16_is_refused():
    from freetx.distributed import MixedPrecisionConfig

    text = refusal({"offload": "cpu"}, mixed_precision=MixedPrecisionConfig("float16"))
    assert "param_dtype=bfloat16" in text


def test_bfloat16_states_of_a_low_bit_optimizer_are_refused():
    low_bit = OmegaConf.create({"optimizer": {"_component_": "torchao.optim.AdamW8bit",
                                              "state_dtype": "bfloat16"}}).optimizer  # fmt: skip
    with pytest.raises(ConfigError, match="8-bit, 4-bit or float8 already"):
        check_optimizer(low_bit, DistributedConfig(), Processes(1, 1, "cpu"), 1, None)


@pytest.mark.parametrize("key,value", [("offload", "nvme"), ("state_dtype", "float16"),
                                       ("in_backward", "yes")])  # fmt: skip
def test_a_value_no_rung_knows_is_refused(key, value):
    assert f"optimizer.{key}={value}" in refusal({key: value}, world=1)


def test_optimizer_offload_with_fsdp_cpu_offload_is_refused():
    assert "Set one of them" in refusal({"offload": "cpu"}, cpu_offload=True)
