"""4-process checks of expert parallelism (run by test_expert_parallel.py through
torchrun): the MoE decoder's gradients of one step, router loss included, under
(ep 2 x dp 2), (ep 4) and (ep 2 x tp 2) equal one process's over the same micro-batches
(one per data-parallel rank: the router loss is a micro-batch's), and each rank holds
E / ep whole experts."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.training import CrossEntropyLoss, count_over_ranks
from tests.distributed.launcher import write_results
from tests.distributed.moe_checks import make_moe, reference_grads
from tests.distributed.parallel_checks import SEED, full_grads, global_batch, max_diff

LAYOUTS = {"ep2_dp2": dict(ep=2), "ep4": dict(ep=4), "ep2_tp2": dict(ep=2, tp=2)}


def expert_parallel_grads(runtime, ep: int, tp: int = 1):
    """One step's full gradients on this rank, the global batch split over the dp ranks;
    and the experts each rank holds of the first MoE block's w1."""
    cfg = OmegaConf.structured(DistributedConfig(strategy="fsdp", ep=ep, tp=tp))
    with torch.device("meta"):
        model = make_moe()
    groups = build_groups(runtime, cfg)
    plan = parallelize(model, groups, cfg, seed=SEED)
    model = plan.model.train()
    inputs, labels = global_batch()
    per_rank = len(inputs) // plan.dp_size
    mine = slice(plan.dp_rank * per_rank, (plan.dp_rank + 1) * per_rank)
    total = count_over_ranks(groups, [(labels[mine] != -100).sum()])
    loss, extras = CrossEntropyLoss()(model, inputs[mine], labels[mine])
    (loss * plan.gradient_ranks / total).backward()
    w1 = plan.module.layers[0].feed_forward.experts.w1
    held = w1.to_local().shape[0] * groups.size("expert_fsdp") if isinstance(w1, DTensor) else 0
    return full_grads(model), extras, held


def main() -> None:
    runtime = init_distributed("cpu")
    results = {}
    for name, layout in LAYOUTS.items():
        dp = runtime.world_size // layout.get("tp", 1)
        expected = reference_grads(micro_batches=dp)
        grads, extras, held = expert_parallel_grads(runtime, **layout)
        results[f"{name}/grad"] = max_diff(grads, expected)
        results[f"{name}/experts_per_rank"] = held
        results[f"{name}/aux_loss"] = extras["aux_loss"].item()
        results[f"{name}/expert_grad"] = (
            grads["layers.0.feed_forward.experts.w2"].abs().sum().item()
        )
    write_results(results)


if __name__ == "__main__":
    main()
