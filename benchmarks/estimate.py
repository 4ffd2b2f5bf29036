"""`freetx estimate` against real runs: llm/small (52M, bf16 compute) at world size 1 and 2.

For each strategy, rank 0's bytes at the peak of a steady training step (the second;
the first creates the optimizer state), three ways, same shape (2 sequences of 256
tokens per rank):
- real: torchrun, gloo, real tensors, torch's memory trackers (FSDPMemTracker /
  MemTracker over every tensor alive, `freetx.planning.measure.tracked_step`);
- measured: `freetx estimate --measure` (one process, fake tensors, a fake group);
- analytic: `freetx estimate` (formulas from the model's shape).
Model states (parameters + gradients + optimizer) are compared exactly; peaks as ratios.

    python benchmarks/estimate.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, local_bytes, table, write_result  # noqa: E402

MIB = 2**20
SHAPE = ["dataset.seq_len=256", "gradient_accumulation_steps=1"]


def config(world_size: int, strategy: str):
    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config

    overrides = [*SHAPE, f"batch_size={2 * world_size}", f"distributed.strategy={strategy}"]
    return load_recipe_config("llm/small", overrides, load_recipe("full_finetune_fsdp2").schema)


def shape_of(strategy: str, world_size: int):
    from freetx.distributed import DistributedConfig, Processes, check_distributed

    return check_distributed(DistributedConfig(strategy=strategy), Processes(world_size))


def worker(strategy: str) -> None:
    import torch

    from freetx.config import instantiate
    from freetx.distributed import (
        StateSharding,
        build_groups,
        destroy_distributed,
        init_distributed,
        parallelize,
    )
    from freetx.planning.config import meta_model
    from freetx.planning.measure import tracked_step

    runtime = init_distributed("cpu")
    cfg = config(runtime.world_size, strategy)
    plan = parallelize(
        meta_model(cfg.model), build_groups(runtime, cfg.distributed), cfg.distributed, seed=0
    )
    optimizer = plan.build_optimizer(cfg.optimizer)
    input_ids = torch.randint(0, cfg.model.vocab_size, (2, 256))
    layout = StateSharding.of(shape_of(strategy, runtime.world_size))
    loss_fn = instantiate(cfg.loss)
    result = tracked_step(plan, optimizer, loss_fn, input_ids, layout)
    with plan.autocast():  # once more, to count the gradients this rank keeps
        loss_fn(plan.model, input_ids, input_ids)[0].backward()
    params = list(plan.model.parameters())
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1's local optimizer
    result["states"] = sum(local_bytes(p) + local_bytes(p.grad) for p in params) + sum(
        local_bytes(v) for state in inner.state.values() for v in state.values()
        if torch.is_tensor(v) and v.dim() > 0  # AdamW's step counters are not state bytes
    )  # fmt: skip
    write_result(result)
    destroy_distributed()  # a group left to the interpreter's exit can abort it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    from freetx.planning.config import meta_model
    from freetx.planning.estimate import estimate
    from freetx.planning.measure import measure

    rows = []
    for world_size, strategies in ((1, ["fsdp"]), (2, ["fsdp", "zero2", "zero1", "ddp"])):
        for strategy in strategies:
            cfg = config(world_size, strategy)
            real = launch(Path(__file__), world_size, "--worker", strategy)
            shape = shape_of(strategy, world_size)
            fake = measure(cfg, shape)
            dist = cfg.distributed
            analytic = estimate(meta_model(cfg.model), [shape], 512, 256,
                                dist.mixed_precision.param_dtype, "none", 2, "cpu", 0.4)[0]  # fmt: skip
            states = real["states"]
            rows.append([
                "plain" if world_size == 1 else strategy, world_size,
                f"{states / MIB:.1f}", f"{analytic.states / MIB:.1f}",
                f"{real['peak'] / MIB:.0f}", f"{fake['peak'] / MIB:.0f}",
                f"{fake['peak'] / real['peak']:.2f}", f"{analytic.peak / MIB:.0f}",
                f"{analytic.peak / real['peak']:.2f}",
            ])  # fmt: skip
    print("llm/small, bf16 compute, 2 x 256 tokens per rank: rank 0 at the peak of a step (MiB)")
    print(table(rows, ["strategy", "ranks", "states real", "analytic", "peak real",
                       "measured", "ratio", "analytic", "ratio"]))  # fmt: skip
    print(
        "(states: parameters + gradients + optimizer state this rank holds after a step; "
        "FSDP2 pads uneven shards)"
    )


if __name__ == "__main__":
    main()
