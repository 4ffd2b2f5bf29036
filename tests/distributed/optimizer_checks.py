"""2-process checks of the optimizer's memory rungs (run by test_optimizer_rungs.py through
torchrun): `optimizer.offload: cpu`, `in_backward: true` and `state_dtype: bfloat16` train
a tiny decoder to the losses and weights of the ordinary optimizer under the same strategy;
a DCP checkpoint saved with a rung on loads with it off and the other way round (the state
has one shape); torchao's low-bit AdamW shards under FSDP2 and resumes exactly.
"""

from __future__ import annotations

import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from freetx.checkpoint.state import ModelState, OptimizerState
from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.objectives import CrossEntropyLoss
from freetx.training import count_over_ranks
from freetx.training.grad import clip_grad_norm
from tests.distributed.launcher import write_results
from tests.distributed.parallel_checks import SEED, SEQ, VOCAB, full_params, make_model, max_diff

ROWS = 8  # per step, over all ranks


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:].clone()


def build(strategy: str, rung: dict, component: str = "torch.optim.AdamW", lora: bool = False,
          **dist_options):  # fmt: skip
    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(DistributedConfig(strategy=strategy, **dist_options))
    with torch.device("meta"):
        model = make_model()
        if lora:
            from freetx.models.peft import apply_lora

            apply_lora(model, ["q", "v", "down"], rank=4, alpha=8)
    groups = build_groups(runtime, cfg)
    plan = parallelize(model, groups, cfg, seed=SEED)
    node = {"_component_": component, "lr": 1e-2, "weight_decay": 0.1, **rung}
    optimizer = plan.build_optimizer(OmegaConf.create({"optimizer": node}).optimizer)
    return plan, optimizer


def train(plan, optimizer, steps: range, clip: float | None, accumulation: int = 1) -> list:
    """The recipe's step: micro-batches (gradients synced on the last), clip, step."""
    runtime, losses = plan.runtime, []
    loss_fn = CrossEntropyLoss()
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = batch(step)
        per_rank = ROWS // runtime.world_size
        mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
        micro = list(zip(inputs[mine].chunk(accumulation), labels[mine].chunk(accumulation)))
        tokens = count_over_ranks(plan.groups, [y.numel() for _, y in micro])
        total = torch.zeros(())
        for i, (x, y) in enumerate(micro):
            with plan.gradient_sync(enabled=i == len(micro) - 1):
                loss, _ = loss_fn(plan.model, x, y)
                (loss * plan.gradient_ranks / tokens).backward()
            total += loss.detach()
        norm = clip_grad_norm(plan.model, clip, plan.groups, optimizer)
        optimizer.step()
        dist.all_reduce(total)
        losses.append((float(total / tokens), norm))
    return losses


def save(plan, optimizer, path: str) -> None:
    dcp.save({"model": ModelState(plan.model), "optimizer": OptimizerState(plan.model, optimizer)},
             checkpoint_id=path)  # fmt: skip


def load(plan, optimizer, path: str) -> None:
    state = {"model": ModelState(plan.model), "optimizer": OptimizerState(plan.model, optimizer)}
    dcp.load(state, checkpoint_id=path)


def differences(a: list, b: list) -> float:
    return max(max(abs(x[0] - y[0]), abs(x[1] - y[1])) for x, y in zip(a, b))


def same_training(results: dict, key: str, strategy: str, rung: dict, clip, accumulation=1,
                  **options) -> None:  # fmt: skip
    """Three steps with the rung vs without it: losses, norms and weights."""
    plan, optimizer = build(strategy, {}, **options)
    reference = train(plan, optimizer, range(3), clip, accumulation)
    ref_params = full_params(plan.model)
    plan, optimizer = build(strategy, rung, **options)
    losses = train(plan, optimizer, range(3), clip, accumulation)
    results[f"{key}/loss"] = differences(losses, reference)
    results[f"{key}/param"] = max_diff(full_params(plan.model), ref_params)


def switched(results: dict, key: str, first: dict, then: dict, clip, tmp: str, strategy="fsdp",
             component="torch.optim.AdamW") -> None:  # fmt: skip
    """Two steps with `first`, saved; loaded with `then` for a third: = three straight with
    `then` (the straight run is the ordinary optimizer when either is)."""
    plan, optimizer = build(strategy, then, component)
    straight = train(plan, optimizer, range(3), clip)
    plan, optimizer = build(strategy, first, component)
    train(plan, optimizer, range(2), clip)
    path = f"{tmp}/{key.replace('/', '_')}"
    save(plan, optimizer, path)
    plan, optimizer = build(strategy, then, component)
    load(plan, optimizer, path)
    resumed = train(plan, optimizer, range(2, 3), clip)
    results[f"{key}/loss"] = differences(resumed, straight[2:])


def main() -> None:
    runtime = init_distributed("cpu")
    results: dict = {"world_size": runtime.world_size}
    offload, in_backward = {"offload": "cpu"}, {"in_backward": True}
    for strategy, options in [("fsdp", {}), ("zero2", {}), ("hsdp", {"replicate_degree": 2}),
                              ("ddp", {}), ("zero1", {})]:  # fmt: skip
        name = strategy + str(options.get("replicate_degree", ""))
        same_training(results, f"offload/{name}", strategy, offload, 0.05, **options)
        if strategy in ("fsdp", "zero2", "hsdp"):
            same_training(results, f"in_backward/{name}", strategy, in_backward, None, **options)
    for strategy in ("fsdp", "ddp"):  # the gradients of 2 micro-batches summed, then copied
        same_training(results, f"offload/{strategy}/accumulation", strategy, offload, 0.05, 2)
        same_training(results, f"bf16_states/{strategy}", strategy, {"state_dtype": "bfloat16"},
                      1.0)  # fmt: skip
    # tensor parallelism: the sliced layers' gradients on a (dp, tp) mesh, the rest's on dp
    same_training(results, "offload/tp2", "fsdp", offload, 0.05, tp=2)
    same_training(results, "in_backward/tp2", "fsdp", in_backward, None, tp=2)
    same_training(results, "in_backward/lora", "fsdp", in_backward, None, lora=True)
    same_training(results, "offload/lora", "fsdp", offload, 1.0, lora=True)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = [scratch]
        dist.broadcast_object_list(tmp)  # one folder for every rank
        switched(results, "switch/plain_to_offload", {}, offload, 0.05, tmp[0])
        switched(results, "switch/offload_to_plain", offload, {}, 0.05, tmp[0])
        switched(results, "switch/in_backward_to_plain", in_backward, {}, None, tmp[0])
        switched(results, "switch/plain_to_in_backward", {}, in_backward, None, tmp[0])
        switched(results, "switch/offload_to_plain/ddp", offload, {}, 0.05, tmp[0], "ddp")
        for component in sys.argv[1:]:  # torchao's low-bit AdamW: sharded, resumed exactly
            short = component.rpartition(".")[2]
            switched(results, f"low_bit/{short}/resume", {}, {}, 1.0, tmp[0], "fsdp", component)
            if short == "AdamW8bit":  # offloaded: the host copies' states are torchao's too
                switched(results, f"low_bit/{short}/offload_resume", offload, offload, 1.0,
                         tmp[0], "fsdp", component)  # fmt: skip
        dist.barrier()
    write_results(results)


if __name__ == "__main__":
    main()
