"""Process group, device, meshes, and how models are parallelized and initialized.

`build_groups(runtime, cfg)` names the ranks by axis (`ParallelGroups`: dp, cp, tp,
dp_cp, world)
and runs every collective; `parallelize(model, groups, cfg, seed)` returns a
`ParallelPlan`, the one object that knows the strategy: nothing outside this
package names one.
"""

from freetx.distributed.context_parallel import ContextShard, check_context_length
from freetx.distributed.frozen import FrozenBase, frozen_base
from freetx.distributed.groups import HostGroup, ParallelGroups
from freetx.distributed.init import (
    canonical_name,
    fill_parameters,
    full_norm,
    full_tensor,
    load_parameters,
    local_parameters,
    materialize,
)
from freetx.distributed.parallelize import (
    DistributedConfig,
    Layout,
    MixedPrecisionConfig,
    ParallelPlan,
    ShardLayout,
    build_groups,
    check_distributed,
    dtype_named,
    parallelize,
    shard_layouts,
    unwrap,
)
from freetx.distributed.runtime import (
    DistributedRuntime,
    build_mesh,
    build_meshes,
    destroy_distributed,
    fake_world,
    init_distributed,
    select_device,
)

__all__ = [
    "ContextShard",
    "check_context_length",
    "DistributedConfig",
    "FrozenBase",
    "DistributedRuntime",
    "build_meshes",
    "HostGroup",
    "ParallelGroups",
    "MixedPrecisionConfig",
    "ParallelPlan",
    "ShardLayout",
    "build_groups",
    "build_mesh",
    "Layout",
    "check_distributed",
    "canonical_name",
    "destroy_distributed",
    "dtype_named",
    "fake_world",
    "frozen_base",
    "fill_parameters",
    "full_norm",
    "full_tensor",
    "init_distributed",
    "load_parameters",
    "local_parameters",
    "materialize",
    "parallelize",
    "select_device",
    "shard_layouts",
    "unwrap",
]
