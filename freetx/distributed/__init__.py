"""Process group, device, meshes, and how models are parallelized and initialized."""

from freetx.distributed.init import canonical_name, fill_parameters, materialize
from freetx.distributed.parallelize import (
    DistributedConfig,
    MixedPrecisionConfig,
    autocast,
    canonical_strategy,
    gradient_scaler,
    gradient_sync,
    parallelize,
    unwrap,
)
from freetx.distributed.runtime import (
    DistributedRuntime,
    build_mesh,
    destroy_distributed,
    init_distributed,
    select_device,
)

__all__ = [
    "DistributedConfig",
    "DistributedRuntime",
    "MixedPrecisionConfig",
    "autocast",
    "build_mesh",
    "canonical_name",
    "canonical_strategy",
    "destroy_distributed",
    "fill_parameters",
    "gradient_scaler",
    "gradient_sync",
    "init_distributed",
    "materialize",
    "parallelize",
    "select_device",
    "unwrap",
]
