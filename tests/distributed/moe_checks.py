"""2-process checks of the MoE decoder (run by test_moe_parallel.py through torchrun):
the gradients of one step, router loss included, equal one process's over the same
micro-batches, under FSDP (which shards whole experts), DDP, and FSDP with full
activation checkpointing (the recomputed blocks count nothing twice)."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from freetx.distributed import (
    DistributedConfig,
    ParallelGroups,
    build_groups,
    init_distributed,
    materialize,
    parallelize,
)
from freetx.models.transformer import decoder
from freetx.objectives import CrossEntropyLoss
from freetx.training import count_over_ranks
from tests.distributed.launcher import write_results
from tests.distributed.parallel_checks import SEED, VOCAB, full_grads, global_batch, max_diff


def make_moe():
    return decoder(vocab_size=VOCAB, hidden_dim=32, num_layers=3, num_heads=4, num_kv_heads=2,
                   ffn_hidden_dim=64, moe_ffn_hidden_dim=32, max_seq_len=16, num_experts=4,
                   experts_per_token=2, router_aux_loss_coef=0.1,
                   mlp_only_layers=[1])  # fmt: skip


def reference_grads(micro_batches: int) -> dict[str, torch.Tensor]:
    """One process: the global batch in `micro_batches` parts (the router loss is a
    micro-batch's), each part's summed loss over the global token count."""
    with torch.device("meta"):
        model = make_moe()
    materialize(model, torch.device("cpu"), SEED)
    model.train()
    inputs, labels = global_batch()
    total = (labels != -100).sum()
    for x, y in zip(inputs.chunk(micro_batches), labels.chunk(micro_batches)):
        loss, _ = CrossEntropyLoss()(model, x, y)
        (loss / total).backward()
    return full_grads(model)


def sharded_grads(strategy: str, activation_checkpointing: str = "none"):
    runtime = init_distributed("cpu")
    cfg = OmegaConf.structured(
        DistributedConfig(strategy=strategy, activation_checkpointing=activation_checkpointing)
    )
    with torch.device("meta"):
        model = make_moe()
    plan = parallelize(model, build_groups(runtime, cfg), cfg, seed=SEED)
    model = plan.model.train()
    inputs, labels = global_batch()
    per_rank = len(inputs) // runtime.world_size
    mine = slice(runtime.rank * per_rank, (runtime.rank + 1) * per_rank)
    total = count_over_ranks(ParallelGroups(runtime), [(labels[mine] != -100).sum()])
    loss, extras = CrossEntropyLoss()(model, inputs[mine], labels[mine])
    (loss * runtime.world_size / total).backward()
    return full_grads(model), extras


def main() -> None:
    expected = reference_grads(micro_batches=2)
    results = {}
    for name, strategy, ac in [("fsdp", "fsdp", "none"), ("ddp", "ddp", "none"),
                               ("fsdp_ac", "fsdp", "full")]:  # fmt: skip
        grads, extras = sharded_grads(strategy, ac)
        results[f"{name}/grad"] = max_diff(grads, expected)
        results[f"{name}/router_grad"] = (
            grads["layers.0.feed_forward.gate.weight"].abs().sum().item()
        )
        results[f"{name}/aux_loss"] = extras["aux_loss"].item()
    # the router loss is a micro-batch's: the whole batch at once differs (not a check of
    # equality but that the comparison above could fail)
    results["whole_batch/grad"] = max_diff(reference_grads(micro_batches=1), expected)
    write_results(results)


if __name__ == "__main__":
    main()
