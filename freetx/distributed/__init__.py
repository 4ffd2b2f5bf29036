"""Process group, device, meshes, and how models are parallelized and initialized.

`MeshShape` is the degree of every axis (its refusals, one build of the meshes);
`build_groups(runtime, cfg)` names the ranks by axis (`ParallelGroups`: dp, cp, tp, pp,
dp_cp, world) and runs every collective; `parallelize(model, groups, cfg, seed)` returns a
`ParallelPlan`, the one object that knows the strategy: nothing outside this
package names one. The `distributed:` section (`DistributedConfig`) and every refusal of
it (`check_distributed`) are config.py's.
"""

from freetx.distributed.config import (
    DistributedConfig,
    MixedPrecisionConfig,
    check_distributed,
    dtype_named,
)
from freetx.distributed.context_parallel import ContextShard
from freetx.distributed.frozen import FrozenBase, frozen_base
from freetx.distributed.groups import HostGroup, ParallelGroups
from freetx.distributed.mesh import MeshShape, Processes
from freetx.distributed.parallelize import (
    ParallelPlan,
    StateSharding,
    build_groups,
    gathered_whole,
    parallelize,
    parallelize_frozen,
    root_gathered,
    unwrap,
)
from freetx.distributed.parameters import (
    canonical_name,
    fill_parameters,
    full_norm,
    full_tensor,
    load_parameters,
    local_parameters,
    materialize,
)
from freetx.distributed.runtime import (
    DistributedRuntime,
    destroy_distributed,
    fake_world,
    init_distributed,
    select_device,
)

__all__ = [
    "ContextShard",
    "DistributedConfig",
    "FrozenBase",
    "DistributedRuntime",
    "MeshShape",
    "HostGroup",
    "ParallelGroups",
    "MixedPrecisionConfig",
    "ParallelPlan",
    "StateSharding",
    "build_groups",
    "Processes",
    "check_distributed",
    "canonical_name",
    "destroy_distributed",
    "dtype_named",
    "fake_world",
    "parallelize_frozen",
    "gathered_whole",
    "root_gathered",
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
    "unwrap",
]
