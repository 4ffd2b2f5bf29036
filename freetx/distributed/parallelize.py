"""`parallelize(model, runtime, cfg)`: one strategy switch for every recipe.

| strategy        | mechanism                                           | known as             |
|-----------------|-----------------------------------------------------|----------------------|
| ddp             | DistributedDataParallel                             | DDP, FSDP no_shard   |
| zero1           | DDP + ZeroRedundancyOptimizer (see build_optimizer) | DeepSpeed ZeRO-1     |
| zero2           | fully_shard(reshard_after_forward=False)            | ZeRO-2, shard_grad_op|
| fsdp (zero3)    | fully_shard per block, then the root                | ZeRO-3, full_shard   |
| hsdp            | fully_shard on a 2-D mesh (replicate x shard)       | hybrid shard         |

The order follows torchtitan: activation checkpointing, per-block compile,
then sharding or DDP. The model arrives on the meta device and leaves
materialized and initialized (see `freetx.distributed.init`). Blocks are found
by module type: each model lists its block classes in `block_types`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from freetx.distributed.init import materialize
from freetx.distributed.runtime import DistributedRuntime, build_mesh
from freetx.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATEGY_ALIASES = {"zero3": "fsdp"}
SHARDED = ("fsdp", "zero2", "hsdp")
REPLICATED = ("ddp", "zero1")

DtypeName = Literal["float32", "bfloat16", "float16"]


@dataclass
class MixedPrecisionConfig:
    """Parameter (compute) and gradient-reduction dtypes. float32/float32 is off."""

    param_dtype: DtypeName = "float32"
    reduce_dtype: DtypeName = "float32"


@dataclass
class DistributedConfig:
    """The `distributed:` section every recipe shares."""

    strategy: Literal["fsdp", "zero3", "zero2", "zero1", "ddp", "hsdp"] = "fsdp"
    # hsdp: number of replicas (shards = world size / replicas). None: one per node.
    replicate_degree: Optional[int] = None
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    cpu_offload: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_every_n_blocks: int = 2  # selective: checkpoint every n-th block
    compile: bool = False


def canonical_strategy(name: str) -> str:
    return STRATEGY_ALIASES.get(name, name)


def check_distributed_config(cfg: DistributedConfig, runtime: DistributedRuntime) -> None:
    """Refuse combinations that cannot work here, before anything is built."""
    strategy = canonical_strategy(cfg.strategy)
    if cfg.cpu_offload:
        if strategy not in SHARDED:
            raise ConfigError(
                f"distributed.cpu_offload works with fsdp, zero2 and hsdp, not {cfg.strategy}.",
                fix="Use distributed.strategy=fsdp, or set distributed.cpu_offload=false.",
            )
        if runtime.device_type == "cpu":
            raise ConfigError(
                "distributed.cpu_offload needs an accelerator: FSDP2's CPUOffloadPolicy moves "
                "parameters between GPU and CPU, and this run is on the CPU already.",
                fix="Set distributed.cpu_offload=false (or run on CUDA).",
            )
    if cfg.mixed_precision.param_dtype == "float16" and strategy in SHARDED:
        raise ConfigError(
            "float16 parameters with FSDP need a sharded gradient scaler, which freetx does "
            "not provide.",
            fix="Use distributed.mixed_precision.param_dtype=bfloat16, or strategy=ddp.",
        )
    if cfg.ac_every_n_blocks < 1:
        raise ConfigError("distributed.ac_every_n_blocks must be at least 1.")
    replicate_degree(cfg, runtime)  # raises when it does not divide the world


def replicate_degree(cfg: DistributedConfig, runtime: DistributedRuntime) -> int:
    """How many replicas an hsdp mesh has (1 for every other strategy)."""
    if canonical_strategy(cfg.strategy) != "hsdp":
        return 1
    degree = cfg.replicate_degree
    if degree is None:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size))
        degree = max(1, runtime.world_size // per_node)
    if degree < 1 or runtime.world_size % degree:
        raise ConfigError(
            f"hsdp: distributed.replicate_degree={degree} does not divide the world size "
            f"{runtime.world_size}, so the ranks cannot form a replicas x shards mesh.",
            fix="Pick a replicate degree that divides the number of processes.",
        )
    return degree


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every_n: int) -> None:
    """Recompute block activations in backward: all blocks, or every n-th."""
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full" or i % every_n == 0:
            checkpoint_activations(block)  # keeps parameter names; preserves RNG state


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, by the module types it names in `block_types`."""
    types = getattr(model, "block_types", None)
    if not types:
        raise ConfigError(
            f"{type(model).__name__} does not name its block classes (`block_types`), so "
            "freetx cannot tell which modules to shard and checkpoint."
        )
    return [m for m in model.modules() if isinstance(m, tuple(types))]


def parallelize(
    model: nn.Module, runtime: DistributedRuntime, cfg: DistributedConfig, seed: int
) -> nn.Module:
    """Apply the configured strategy to a meta-device model, then materialize it.

    Returns the model to train (a DDP wrapper for ddp/zero1, the sharded model
    itself otherwise; at world size 1 the plain model, unless CPU offload needs
    FSDP). Initial weights depend only on `seed`, not on the
    strategy or the world size.
    """
    check_distributed_config(cfg, runtime)
    strategy = canonical_strategy(cfg.strategy)
    blocks = find_blocks(model)
    apply_activation_checkpointing(blocks, cfg.activation_checkpointing, cfg.ac_every_n_blocks)
    if cfg.compile:
        for block in blocks:
            block.compile()
    if runtime.world_size == 1 and not cfg.cpu_offload:
        # nothing to shard or replicate: the plain model is the fastest way to train
        materialize(model, runtime.device, seed)
        return model
    if strategy in REPLICATED:
        materialize(model, runtime.device, seed)
        device_ids = [runtime.local_rank] if runtime.device_type == "cuda" else None
        # gradients as views of the all-reduce buckets: no second copy of the gradients
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)

    mesh = build_mesh(runtime, replicate_degree(cfg, runtime))
    options = {
        "mesh": mesh,
        "reshard_after_forward": strategy != "zero2",
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=DTYPES[cfg.mixed_precision.param_dtype],
            reduce_dtype=DTYPES[cfg.mixed_precision.reduce_dtype],
        ),
    }
    if cfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)  # the root gets the same policy as the blocks
    # offloaded parameters live on the CPU; buffers (RoPE tables) stay on the device
    param_device = torch.device("cpu") if cfg.cpu_offload else runtime.device
    materialize(model, param_device, seed, buffer_device=runtime.device)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 models are not wrapped)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip gradient communication for micro-batches that are not the last one.

    FSDP2: `set_requires_gradient_sync`; DDP (and ZeRO-1): `no_sync()`.
    """
    if isinstance(model, DistributedDataParallel):
        with nullcontext() if enabled else model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def autocast(model: nn.Module, runtime: DistributedRuntime, cfg: DistributedConfig):
    """Autocast for the replicated strategies (FSDP2 casts through its policy)."""
    dtype = DTYPES[cfg.mixed_precision.param_dtype]
    if dtype == torch.float32 or isinstance(model, FSDPModule):
        return nullcontext()
    return torch.autocast(runtime.device_type, dtype=dtype)


def gradient_scaler(runtime: DistributedRuntime, cfg: DistributedConfig) -> torch.amp.GradScaler:
    """A GradScaler, enabled only for float16 (a no-op pass-through otherwise)."""
    enabled = cfg.mixed_precision.param_dtype == "float16"
    return torch.amp.GradScaler(runtime.device_type, enabled=enabled)
