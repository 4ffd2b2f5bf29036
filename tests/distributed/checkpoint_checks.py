"""Resharding checks (run by test_checkpoint_resharding.py through torchrun).

Arguments are tasks, run in order, each `ACTION:STRATEGY:DIR`:

    save:STRATEGY:DIR   train 2 steps, save a checkpoint to DIR, record outputs
    load:STRATEGY:DIR   load DIR into a freshly built model, record outputs

The test saves with one world size / strategy and loads with another; the
outputs on a fixed batch (and after one more optimizer step) must be equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from freetx.checkpoint import ModelState, OptimizerState, TrainState
from freetx.checkpoint.dcp_folder import SafeLoadPlanner
from freetx.distributed import DistributedConfig, build_groups, init_distributed, parallelize
from freetx.models.transformer import decoder
from tests.distributed.launcher import write_results


def build(strategy: str):
    runtime = init_distributed("cpu")
    with torch.device("meta"):
        model = decoder(vocab_size=64, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                        ffn_hidden_dim=64, max_seq_len=16)  # fmt: skip
    cfg = OmegaConf.structured(DistributedConfig(strategy=strategy))
    plan = parallelize(model, build_groups(runtime, cfg), cfg, seed=1)
    optimizer = plan.build_optimizer(
        OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-2})
    )
    return runtime, plan.model, optimizer


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(seed))


def train_step(model, optimizer, seed: int) -> None:
    model(batch(seed)).float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def run_task(action: str, strategy: str, path: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    runtime, model, optimizer = build(strategy)
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer),
             "train": TrainState()}  # fmt: skip
    if action == "save":
        train_step(model, optimizer, 1)
        train_step(model, optimizer, 2)
        state["train"].step = 2
        dcp.save(state, checkpoint_id=str(path))
    else:
        dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner())
    with torch.no_grad():
        outputs = model(batch(9)).tolist()
    train_step(model, optimizer, 3)  # one more step: the optimizer state must match too
    with torch.no_grad():
        after_step = model(batch(9)).tolist()
    return {"outputs": outputs, "after_step": after_step, "step": state["train"].step,
            "world_size": runtime.world_size}  # fmt: skip


def main() -> None:
    results = {}
    for task in sys.argv[1:]:
        action, strategy, path = task.split(":", 2)
        results[task] = run_task(action, strategy, Path(path))
    write_results(results)


if __name__ == "__main__":
    main()
