"""Process group, device, meshes, and (with the recipes) how models are parallelized."""

from freetx.distributed.runtime import (
    DistributedRuntime,
    build_mesh,
    destroy_distributed,
    init_distributed,
    select_device,
)

__all__ = [
    "DistributedRuntime",
    "build_mesh",
    "destroy_distributed",
    "init_distributed",
    "select_device",
]
