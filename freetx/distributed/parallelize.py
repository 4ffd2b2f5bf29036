"""`parallelize(model, runtime, cfg, seed) -> ParallelPlan`: one strategy switch for
every recipe, and the only place that knows the strategies.

| strategy        | mechanism                                              | known as             |
|-----------------|--------------------------------------------------------|----------------------|
| ddp             | DistributedDataParallel                                | DDP, FSDP no_shard   |
| zero1           | DDP + ZeroRedundancyOptimizer (plan.build_optimizer)   | DeepSpeed ZeRO-1     |
| zero2           | fully_shard(reshard_after_forward=False)               | ZeRO-2, shard_grad_op|
| fsdp (zero3)    | fully_shard per block, then the root                   | ZeRO-3, full_shard   |
| hsdp            | fully_shard on a 2-D mesh (replicate x shard)          | hybrid shard         |

The order follows torchtitan: tensor parallelism's slices, float8's Linears,
activation checkpointing, per-block compile, then sharding or DDP. The model arrives
on the meta device and leaves materialized and initialized (see `freetx.distributed.parameters`). Blocks are found
by module type (the model's `block_types`); a model with none is sharded and
checkpointed as one unit. The returned `ParallelPlan` answers every
strategy-specific question a recipe has: what to call, the model under any
wrapper, the optimizer (ZeRO-1 included), gradient sync, autocast, the scaler. The
`distributed:` section it applies, and every refusal of it, is freetx.distributed.config.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.nn.parallel import DistributedDataParallel

from freetx.config.instantiate import COMPONENT, import_component, node_path
from freetx.distributed.activation_offload import OffloadActivations
from freetx.distributed.config import DTYPES, DistributedConfig, check_distributed
from freetx.distributed.context_parallel import ContextShard, check_shards_context
from freetx.distributed.expert_parallel import (
    apply_expert_parallel,
    check_model_experts,
    check_same_forwards,
    expert_modules,
)
from freetx.distributed.float8 import (
    check_float8_device,
    convert_to_float8,
    precompute_float8_scales,
)
from freetx.distributed.frozen import FrozenBase, frozen_base
from freetx.distributed.groups import ParallelGroups
from freetx.distributed.mesh import REPLICATED, MeshShape, Processes, canonical_strategy
from freetx.distributed.optimizer import build_optimizer, offloaded
from freetx.distributed.parameters import canonical_name, materialize
from freetx.distributed.pipeline import Pipeline, check_micro_batches, split_into_stages
from freetx.distributed.runtime import DistributedRuntime
from freetx.distributed.scaler import GradScaler
from freetx.distributed.tensor_parallel import apply_tensor_parallel, enable_async_tp
from freetx.models.protocol import ExtraForwards, HasBlocks, check_model


@dataclass(frozen=True)
class StateSharding:
    """How a strategy spreads the model states over its data-parallel ranks: what each
    rank holds (1 / shards of each), what it gathers, and how gradients travel. For
    estimates made before a run (`freetx estimate`)."""

    strategy: str
    parameter_shards: int
    gradient_shards: int
    optimizer_shards: int
    blocks_stay_gathered: bool  # zero2: every block unsharded from its forward to its backward
    gathers_per_block: bool  # fsdp, hsdp: a block gathered for its forward and its backward
    all_reduce: bool  # ddp, zero1: the gradients all-reduced (else reduce-scattered)
    replicas: int = 1  # hsdp: the replica groups (each shards over dp_shard x cp)

    @classmethod
    def of(cls, shape: MeshShape) -> StateSharding:
        """The layout of `shape.strategy` on the data-parallel ranks of `shape`."""
        strategy, shards, replicas = shape.strategy, shape.fsdp, shape.dp_replicate
        if strategy == "ddp":
            return cls("ddp", 1, 1, 1, False, False, True)
        if strategy == "zero1":
            return cls("zero1", 1, 1, shape.dp, False, False, True)
        if strategy == "zero2":
            return cls("zero2", shards, shards, shards, True, False, False)
        return cls(strategy, shards, shards, shards, False, True, False, replicas)


_FUSABLE = (torch.optim.AdamW, torch.optim.Adam)


@dataclass
class ParallelPlan:
    """What `parallelize` made, and every strategy-specific answer a recipe needs."""

    model: nn.Module  # what to call and train: DDP wrapper, FSDP2-sharded model, or plain
    module: nn.Module  # the model itself, under any wrapper: its config and protocol methods
    strategy: str  # the canonical strategy name (for the banner and checkpoints' meta)
    groups: ParallelGroups  # the ranks by axis (dp, cp, tp, world) and their collectives
    cfg: Any  # the `distributed:` section
    scaler: GradScaler = field(init=False)  # float16 only: agreed over the ranks
    # distributed.cp > 1: this rank's part of each sequence (`TokenBatch.split`, and the model's
    # forward(context=...)); None without context parallelism
    context: ContextShard | None = field(init=False)
    # distributed.pp > 1: this rank's pipeline stages and their schedule (`parallelize`)
    pipeline: Pipeline | None = field(default=None, init=False)
    optimizer: Any = field(default=None, init=False)  # what `build_optimizer` made
    # distributed.float8=tensorwise under FSDP2: weights all-gathered in float8, their
    # scales computed after each optimizer step (`after_optimizer_step`)
    float8_all_gather: bool = field(default=False, init=False)

    @property
    def runtime(self) -> DistributedRuntime:
        return self.groups.runtime

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        return self.groups.dp_size

    def __post_init__(self) -> None:
        # enabled only for float16 (a no-op pass-through otherwise)
        enabled = self.cfg.mixed_precision.param_dtype == "float16"
        self.scaler = GradScaler(self.groups, enabled=enabled)
        self.context = ContextShard(self.groups) if self.groups.size("cp") > 1 else None

    @property
    def gradient_ranks(self) -> int:
        """The ranks whose gradients DDP or FSDP2 average (dp x cp: they hold different
        tokens of the global batch), which a summed loss is multiplied back by."""
        return self.groups.size("dp_cp")

    @property
    def replicated(self) -> bool:
        """Every rank holds the whole parameters (DDP, ZeRO-1, or a world of one)."""
        return not isinstance(self.model, FSDPModule)

    @property
    def inference_model(self) -> nn.Module:
        """The model for forward passes that differ between ranks (per-rank rollouts):
        the bare module when parameters are replicated (no collective in its forward);
        the sharded model otherwise, where every rank must run as many forwards. Refused
        with expert parallelism (`_check_same_forwards`)."""
        self._check_same_forwards()
        return self.module if self.replicated else self.model

    def _check_same_forwards(self) -> None:
        """The refusal of the entry points to forwards that differ between ranks
        (`inference_model`, `gathered`): expert parallelism, whose forwards send tokens to
        the other ranks of their ep group (`check_same_forwards`; a run refuses what
        would run them before it starts: `freetx.training.config.check_per_rank_forwards`)."""
        check_same_forwards(self.groups.size("ep"), "generating or scoring per rank")

    @contextmanager
    def gathered(self):
        """The model for many forwards that differ between ranks (generation: each rank
        its own prompts, stopping when its rows end), yielded: every FSDP2-sharded
        parameter gathered once on entry (one all-gather per sharded module) and kept
        whole until exit, where each is sharded again, so that the forwards inside run
        no collective over the sharding axes. Replicated parameters: the bare module.
        Tensor-parallel layers still reduce over `tp` in each forward; the tp ranks of
        one data shard generate the same rows, so they run the same forwards. Refused
        with expert parallelism, whose forwards send tokens to other ranks."""
        self._check_same_forwards()
        if self.replicated:
            yield self.module
            return
        with gathered_whole(self.model, reshard_after_forward=self.strategy != "zero2"):
            yield self.model

    def build_optimizer(self, node) -> torch.optim.Optimizer:
        """The optimizer a `_component_` node names, over the trainable parameters, with
        the node's memory rungs (`optimizer.offload`, `in_backward`, `state_dtype`:
        freetx.distributed.optimizer).

        - zero1: the optimizer class runs inside ZeroRedundancyOptimizer, so each
          rank keeps the state of its share of the parameters (DeepSpeed ZeRO-1).
        - On CUDA, torch's Adam/AdamW get `fused=True` unless the config says.
        Any optimizer class works, torchao's low-bit ones included
        (`_component_: torchao.optim.AdamW8bit`).
        """
        target = import_component(node[COMPONENT], f"{node_path(node)}._component_")
        fused = self.runtime.device_type == "cuda" and target in _FUSABLE and "fused" not in node
        zero = None
        if self.strategy == "zero1" and self.runtime.world_size > 1:  # nothing to share at 1
            # imported here: torch.distributed.optim scripts its optimizers on import (~0.4 s)
            from torch.distributed.optim import ZeroRedundancyOptimizer as zero
        names = {id(p): canonical_name(n) for n, p in self.model.named_parameters()}
        self.optimizer = build_optimizer(
            node,
            self.model,
            names,
            replicated=self.replicated and self.runtime.world_size > 1,
            zero=zero,
            fused=fused,
        )
        return self.optimizer

    @contextmanager
    def gradient_sync(self, enabled: bool):
        """Skip gradient communication for micro-batches that are not the last one.

        FSDP2: `set_requires_gradient_sync`; DDP (and ZeRO-1): `no_sync()`. An offloaded
        optimizer copies the gradients to the host in the last one's backward only.
        """
        model = self.model
        host = offloaded(self.optimizer)
        if host is not None:
            host.copy_gradients(enabled)
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

    def autocast(self):
        """Autocast for replicated parameters (FSDP2 casts through its policy)."""
        dtype = DTYPES[self.cfg.mixed_precision.param_dtype]
        if dtype == torch.float32 or isinstance(self.model, FSDPModule):
            return nullcontext()
        return torch.autocast(self.runtime.device_type, dtype=dtype)

    def offloaded_activations(self):
        """Around a forward: with distributed.activation_offloading, the activations it
        saves for backward go to host memory and come back for the backward (the model's
        buffers stay); a no-op context otherwise."""
        if not self.cfg.activation_offloading:
            return nullcontext()
        return OffloadActivations(self.runtime.device, keep=self.module.buffers())

    def after_optimizer_step(self) -> None:
        """What follows every optimizer step: with float8 all-gather, the float8 scales
        of the updated weights for their next all-gather (one all-reduce); else nothing."""
        if self.float8_all_gather:
            precompute_float8_scales(self.model)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str, every_n: int) -> None:
    """Recompute block activations in backward: all blocks, or every n-th."""
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "full" or i % every_n == 0:
            checkpoint_activations(block)  # keeps parameter names; preserves RNG state


def store_frozen_bases_in(model: nn.Module, dtype: torch.dtype, frozen: FrozenBase) -> None:
    """The frozen parameters the decision keeps in the compute dtype (`frozen.
    in_compute_dtype`, e.g. LoRA's base under bf16 mixed precision) are stored in it: they
    never get an update, so an fp32 master copy would only double their memory."""
    if dtype == torch.float32:
        return
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = canonical_name(f"{module_name}.{name}" if module_name else name)
            if full in frozen.in_compute_dtype:
                stored = torch.empty(param.shape, dtype=dtype, device=param.device)
                setattr(module, name, nn.Parameter(stored, requires_grad=False))


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, by the module types it names in `block_types`; a model that
    names none is one block (sharded, checkpointed and compiled whole)."""
    types = tuple(model.block_types or ()) if isinstance(model, HasBlocks) else ()
    if not types:
        return []
    return [m for m in model.modules() if isinstance(m, types)]


def build_groups(runtime: DistributedRuntime, cfg: DistributedConfig) -> ParallelGroups:
    """The job's ranks by axis for this `distributed:` section, before data or model are
    made (data reads `groups.dp_rank`'s share), with the meshes the layout shards over.
    Refuses combinations that cannot work first."""
    shape = check_distributed(cfg, Processes.of(runtime))
    check_float8_device(cfg.float8, runtime.device)
    meshes = shape.build(runtime.device_type) if shape.needs_mesh(cfg.cpu_offload) else {}
    return ParallelGroups(runtime, shape, meshes)


def parallelize(
    model: nn.Module,
    groups: ParallelGroups,
    cfg,
    seed: int,
    init_weights: bool = True,
    frozen: FrozenBase | None = None,
    micro_batches: int = 1,
) -> ParallelPlan:
    """Apply the configured strategy to a meta-device model, then materialize it.

    The plan's `model` is a DDP wrapper for ddp/zero1, the sharded model itself
    otherwise, and the plain model at world size 1 (unless CPU offload needs
    FSDP). Initial weights depend only on `seed`, not on the strategy or the
    world size; `init_weights=False` skips them for a run that loads its weights
    (a resume, or `checkpoint.initial_weights`). `groups` comes from `build_groups`
    with the same `cfg`. `frozen`: the frozen-base decision (`frozen_base`; made here
    from the model when not given). The model is checked against the model protocol
    first (`check_model`). With `distributed.pp` > 1 the model is first pruned to this
    rank's pipeline stages, and the plan's `pipeline` runs an optimizer step's
    `micro_batches` (gradient_accumulation_steps) through them.
    """
    check_model(model)
    runtime = groups.runtime
    check_distributed(cfg, Processes.of(runtime))
    strategy = canonical_strategy(cfg.strategy)
    frozen = frozen or frozen_base(model)
    store_frozen_bases_in(model, DTYPES[cfg.mixed_precision.param_dtype], frozen)
    if cfg.cp > 1:  # whatever the recipe: a model that cannot take a part is refused here
        check_shards_context(model)
    if cfg.ep > 1:  # the whole model's experts, before a pipeline stage prunes them
        check_model_experts(model, cfg.ep)
    num_blocks = len(find_blocks(model))
    stages = None
    if cfg.pp > 1:
        check_micro_batches(cfg, micro_batches)
        stages = split_into_stages(model, cfg, groups, num_blocks)
    if groups.tp_mesh is not None:  # first, as torchtitan: slices, then AC, compile, FSDP2
        apply_tensor_parallel(model, groups.tp_mesh, cfg.sequence_parallel and cfg.pp == 1)
        if cfg.async_tp:
            enable_async_tp(groups.tp_mesh)
    if groups.ep_mesh is not None:  # the experts spread over ep, before AC and FSDP2
        apply_expert_parallel(model, groups.ep_mesh)
    # float8 all-gather: tensorwise under FSDP2, its shards on the device (not offloaded)
    sharded = strategy not in REPLICATED and runtime.world_size > 1 and not cfg.cpu_offload
    float8_all_gather = cfg.float8 == "tensorwise" and sharded
    if cfg.float8 != "none":  # after tp's slices (refused with tp > 1), before AC
        convert_to_float8(model, cfg.float8, float8_all_gather)
    blocks = find_blocks(model)
    whole = blocks or [model]  # a model without blocks is one unit
    apply_activation_checkpointing(whole, cfg.activation_checkpointing, cfg.ac_every_n_blocks)
    if cfg.compile:
        for block in whole:
            block.compile()

    def plan(trained: nn.Module) -> ParallelPlan:
        made = ParallelPlan(trained, model, strategy, groups, cfg)
        made.float8_all_gather = float8_all_gather
        return made

    if runtime.world_size == 1 and not cfg.cpu_offload:
        # nothing to shard or replicate: the plain model is the fastest way to train
        materialize(model, runtime.device, seed, init_weights=init_weights)
        return plan(model)
    if strategy in REPLICATED:
        materialize(model, runtime.device, seed, init_weights=init_weights)
        device_ids = [runtime.local_rank] if runtime.device_type == "cuda" else None
        # gradients as views of the all-reduce buckets: no second copy of the gradients;
        # no broadcast of rank 0's weights at start: every rank initializes the same values
        # from (seed, name) and loads the same files (an NF4 base is set only after this)
        return plan(
            DistributedDataParallel(
                model, device_ids=device_ids, gradient_as_bucket_view=True, init_sync=False
            )
        )

    shard_blocks(model, blocks, groups, cfg, reshard_after_forward=strategy != "zero2")
    if isinstance(model, ExtraForwards):  # methods gathered like forward
        for method in model.fsdp_forward_methods:
            register_fsdp_forward_method(model, method)
    if stages is not None:  # a pipeline stage's forward, gathered like forward
        register_fsdp_forward_method(model, "forward_stage")
    # offloaded parameters live on the CPU; buffers (RoPE tables) stay on the device
    param_device = torch.device("cpu") if cfg.cpu_offload else runtime.device
    materialize(model, param_device, seed, buffer_device=runtime.device, init_weights=init_weights)
    made = plan(model)
    if stages is not None:
        made.pipeline = Pipeline(
            model,
            stages,
            groups,
            cfg,
            micro_batches,
            made.context,
            made.scaler if made.scaler.is_enabled() else None,
            num_blocks,
        )
    return made


def shard_blocks(
    model: nn.Module,
    blocks: list[nn.Module],
    groups: ParallelGroups,
    cfg,
    reshard_after_forward: bool,
) -> None:
    """FSDP2 over `groups.mesh`: each block a unit, then the root, with the `distributed:`
    section's mixed precision and CPU offload. With expert parallelism each block's
    experts (spread over ep: `apply_expert_parallel`) are a unit of their own first,
    sharded over `groups.expert_mesh` (dp_shard / ep x cp), their gradients averaged over all
    dp x cp ranks' tokens as every other gradient is (each rank's experts summed the
    rows of its ep group)."""
    if groups.mesh is None:
        raise ValueError("parallelize: a sharded strategy needs the groups of build_groups")
    options = {
        "mesh": groups.mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=DTYPES[cfg.mixed_precision.param_dtype],
            reduce_dtype=DTYPES[cfg.mixed_precision.reduce_dtype],
        ),
    }
    if cfg.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    if groups.expert_mesh is not None:
        for experts in expert_modules(model).values():
            fully_shard(experts, **{**options, "mesh": groups.expert_mesh})
            experts.set_gradient_divide_factor(groups.size("dp_cp"))
            # gloo has no PREMUL_SUM: a sum, then the division; not on one rank, where
            # torch 2.13's FSDP2 would divide twice (no collective to choose an op for)
            if groups.runtime.device_type == "cpu" and groups.size("expert_fsdp") > 1:
                experts.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)  # the root gets the same policy as the blocks


def parallelize_frozen(
    model: nn.Module, groups: ParallelGroups, cfg, seed: int, init_weights: bool = False
) -> nn.Module:
    """A frozen copy of a meta-device model, parallelized as `parallelize` would the policy
    it sits beside (a preference loss's reference, a teacher): no gradients, no optimizer
    state, its parameters stored in the compute dtype (`mixed_precision.param_dtype`), its
    weights initialized from `seed` as the policy's (`init_weights`) or left for the
    caller to load. Sharded per block by FSDP2 under the
    sharded strategies, resharded after each forward; whole on every rank under the
    replicated ones (no DDP wrapper: nothing trains); sliced under tensor parallelism.
    Returns the model to call, in eval mode. Pipeline parallelism is refused (`check`:
    the recipe's)."""
    check_model(model)
    runtime = groups.runtime
    model.requires_grad_(False)
    model.to(DTYPES[cfg.mixed_precision.param_dtype])  # meta: the dtype its storage gets
    if groups.tp_mesh is not None:
        apply_tensor_parallel(model, groups.tp_mesh, cfg.sequence_parallel)
    if groups.ep_mesh is not None:
        check_model_experts(model, cfg.ep)
        apply_expert_parallel(model, groups.ep_mesh)
    blocks = find_blocks(model)
    if cfg.compile:
        for block in blocks or [model]:
            block.compile()
    if runtime.world_size == 1 or canonical_strategy(cfg.strategy) in REPLICATED:
        materialize(model, runtime.device, seed, init_weights=init_weights)
        return model.eval()
    shard_blocks(model, blocks, groups, cfg, reshard_after_forward=True)
    param_device = torch.device("cpu") if cfg.cpu_offload else runtime.device
    materialize(model, param_device, seed, buffer_device=runtime.device, init_weights=init_weights)
    return model.eval()


@contextmanager
def gathered_whole(model: nn.Module, reshard_after_forward: bool = True):
    """Every FSDP2-sharded module of `model` gathered once on entry (one all-gather each:
    every rank enters together) and kept whole until exit, where each is sharded again
    and its blocks go back to `reshard_after_forward`; the forwards inside run no
    collective over the sharding axes, so they may differ between ranks. Nothing to do
    for a model that is not sharded."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for module in sharded:
            module.unshard()  # the root's first: FSDP2's lazy init, then every block's
            module.set_reshard_after_forward(False, recurse=False)
        yield model
    finally:  # those gathered before a failure too
        for module in sharded:
            module.reshard()
            if module is not model:  # the root stays gathered after forward
                module.set_reshard_after_forward(reshard_after_forward, recurse=False)


@contextmanager
def root_gathered(model: nn.Module):
    """A frozen FSDP2 model's root unit (its embedding, final norm and head: what is not in
    a block) kept gathered inside, so that its head can project hidden states outside
    the model's own forward (a teacher's, in the student's distillation loss); nothing
    to do for a model that is not sharded."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 models are not wrapped)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
