"""Process group, device, meshes, and how models are parallelized and initialized.

`parallelize(model, runtime, cfg, seed)` returns a `ParallelPlan`, the one object
that knows the strategy: nothing outside this package names one.
"""

from freetx.distributed.frozen import FrozenBase, frozen_base
from freetx.distributed.init import canonical_name, fill_parameters, load_parameters, materialize
from freetx.distributed.parallelize import (
    DistributedConfig,
    MixedPrecisionConfig,
    ParallelPlan,
    ShardLayout,
    check_world_fits,
    dtype_named,
    parallelize,
    shard_layouts,
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
    "FrozenBase",
    "DistributedRuntime",
    "MixedPrecisionConfig",
    "ParallelPlan",
    "ShardLayout",
    "build_mesh",
    "check_world_fits",
    "canonical_name",
    "destroy_distributed",
    "dtype_named",
    "frozen_base",
    "fill_parameters",
    "init_distributed",
    "load_parameters",
    "materialize",
    "parallelize",
    "select_device",
    "shard_layouts",
    "unwrap",
]
