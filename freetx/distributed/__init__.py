"""Process group, device, meshes, and how models are parallelized and initialized.

`parallelize(model, runtime, cfg, seed)` returns a `ParallelPlan`, the one object
that knows the strategy: nothing outside this package names one.
"""

from freetx.distributed.groups import HostGroup, ParallelGroups
from freetx.distributed.init import (
    canonical_name,
    fill_parameters,
    full_tensor,
    load_parameters,
    materialize,
)
from freetx.distributed.parallelize import (
    DistributedConfig,
    MixedPrecisionConfig,
    ParallelPlan,
    ShardLayout,
    build_groups,
    check_world_fits,
    parallelize,
    shard_layouts,
    unwrap,
)
from freetx.distributed.runtime import (
    DistributedRuntime,
    build_mesh,
    destroy_distributed,
    fake_world,
    init_distributed,
    select_device,
)

__all__ = [
    "DistributedConfig",
    "DistributedRuntime",
    "HostGroup",
    "ParallelGroups",
    "MixedPrecisionConfig",
    "ParallelPlan",
    "ShardLayout",
    "build_groups",
    "build_mesh",
    "check_world_fits",
    "canonical_name",
    "destroy_distributed",
    "fake_world",
    "fill_parameters",
    "full_tensor",
    "init_distributed",
    "load_parameters",
    "materialize",
    "parallelize",
    "select_device",
    "shard_layouts",
    "unwrap",
]
